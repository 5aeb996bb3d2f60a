"""paged-transformers: a paged KV cache, PagedAttention kernels and continuous batching for
Hugging Face transformers models.

Public API::

    from paged_transformers import paged_generate, SamplingParams, EngineConfig, LLMEngine, PagedCache
    import paged_transformers; paged_transformers.patch()   # model.generate() through the engine
    from paged_transformers import engine_for, release       # the model's warm engine; free it
"""

from importlib import import_module as _import_module
from pathlib import Path as _Path

from ._source_tree import map_source_folders as _map_source_folders

_map_source_folders(__name__, _Path(__file__).resolve().parent)  # before any import of .kernels or .patches

__version__ = "0.1.0"

# public name -> its module. Imported on first use (PEP 562 ``__getattr__``), so that importing the package (and
# ``paged-transformers --version``) does not import torch and transformers.
_EXPORTS = {
    "AttentionBackend": ".config",
    "CompletionOutput": ".outputs",
    "EngineConfig": ".config",
    "LLM": ".entrypoints.llm",
    "LLMEngine": ".core.engine",
    "ModelEngine": ".entrypoints.llm",
    "PagedCache": ".integration.cache",
    "RequestMetrics": ".outputs",
    "RequestOutput": ".outputs",
    "SamplingParams": ".sampling_params",
    "PerRequest": ".logits_process",
    "engine_for": ".integration.warm",
    "load_model": ".quantization",
    "paged_generate": ".integration.generate",
    "patch": ".patches.generate",
    "release": ".integration.warm",
    "unpatch": ".patches.generate",
}


def __getattr__(name: str):
    """A public name (``_EXPORTS``), imported from its module on first use and kept here.

    Raises:
        AttributeError: ``name`` is not one of them.
    """
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = list(_EXPORTS)
