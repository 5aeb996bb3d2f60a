"""The attention metadata of the engine forward in progress, for layers that do not pass ``paged_metadata`` on.

The runner hands each step's ``AttentionMetadata`` to ``model(...)`` as the keyword argument ``paged_metadata``.
Some models' decoder layers drop keyword arguments on their way down to attention, so the engine installs
``install_step_hooks`` on the model: they keep the metadata of the forward in progress, per thread, and the paged
attention function (``core/attention.py``) and the fused eager layers (``compilation/fused_layers.py``) fall back
to ``current_metadata()``. It lives below both so that neither package imports the other for it.
"""

import threading

import torch

__all__ = ["current_metadata", "install_step_hooks"]

_step = threading.local()  # .metadata: the AttentionMetadata of the engine forward in progress, or None


def current_metadata():
    """The ``AttentionMetadata`` of the engine forward in progress on this thread, or None outside one."""
    return getattr(_step, "metadata", None)


def _remember_metadata(module, args, kwargs) -> None:
    _step.metadata = kwargs.get("paged_metadata")


def _forget_metadata(module, args, kwargs, output) -> None:
    _step.metadata = None


def install_step_hooks(model: torch.nn.Module) -> list:
    """Forward hooks on the top-level model that keep the ``paged_metadata`` of the forward in progress
    (cleared when it returns or raises), for layers that do not pass keyword arguments on.

    Returns:
        The hook handles; call ``.remove()`` on each to uninstall.
    """
    return [
        model.register_forward_pre_hook(_remember_metadata, with_kwargs=True),
        model.register_forward_hook(_forget_metadata, with_kwargs=True, always_call=True),
    ]
