"""``kernels/`` and ``patches/`` as subpackages of ``paged_transformers`` when it is imported from a source checkout.

The installed package holds them (setup.py maps the top-level folders ``kernels/`` and ``patches/`` to
``paged_transformers.kernels`` / ``paged_transformers.patches``). A checkout does not: there they lie beside
``paged_transformers/``, and Python run from the checkout root (``python -c``, a script saved there,
``python -m paged_transformers...``) imports ``paged_transformers`` from the checkout, ahead of any installed copy,
because the current directory comes first on ``sys.path``. ``map_source_folders`` registers each folder as the
subpackage the install would make of it, so that the checkout imports as the installed package does.

Neither folder has an ``__init__.py``: with one, ``import kernels`` from the checkout root would import our
``kernels/`` instead of Hugging Face's ``kernels`` package (which transformers imports). Without one, the folder is
only a namespace portion, and a regular package later on ``sys.path`` wins over it. So both subpackages are
namespace packages, installed or not.
"""

import importlib.util
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

MAPPED_FOLDERS = ("kernels", "patches")  # top-level folders of the checkout, subpackages of the installed package


def map_source_folders(package: str, package_dir: Path) -> None:
    """Register ``<package_dir>/../<folder>`` as the namespace package ``<package>.<folder>`` for each of
    ``MAPPED_FOLDERS`` that ``package_dir`` does not hold itself (a checkout); a no-op for an installed package
    (the folders are inside it) and for a subpackage already imported.

    Args:
        package: the package's name (``paged_transformers``), already in ``sys.modules``.
        package_dir: the folder of its ``__init__.py``.
    """
    for folder in MAPPED_FOLDERS:
        name = f"{package}.{folder}"
        source = package_dir.parent / folder
        if name in sys.modules or (package_dir / folder).is_dir() or not source.is_dir():
            continue
        spec = ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(source)]
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        setattr(sys.modules[package], folder, module)
