"""What changed in a model's parameters and buffers since a snapshot: values written in place, or tensors replaced.

A warm engine (``warm.py``) outlives calls, and between calls the model is the user's: an optimizer step,
``load_state_dict`` or a merged adapter changes the weights the next call must compute with. The engine checks once
per call, when it is attached, against the snapshot taken when it was last detached:

- **updated**: the same tensors, written in place (``param.add_``, ``optimizer.step()``, ``load_state_dict``,
  ``param.copy_``): each bumps the tensor's version counter. The engine computes with live weights (its fused
  projections and CUDA graphs read the same storage), but K/V cached from the old weights is stale, so the prefix
  cache is dropped.
- **replaced**: a tensor is another object, at another address, or of another device, dtype or shape
  (``param.data = ...``, a new ``nn.Parameter``, ``model.to(...)``, ``model.half()``, a wrapped module): the
  engine's fused weights and captured graphs still read the old storage, so the engine must be rebuilt.

NOTE: writes through ``.data`` (``param.data.add_(...)``, ``param.data.copy_(...)``) bypass the version counter, so
they are invisible here; after such writes call ``engine.reset_prefix_cache()`` (or ``paged_transformers.release(model)``).
"""

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch


class WeightsChange(enum.Enum):
    """How a model's tensors differ from a snapshot."""

    NONE = "none"
    UPDATED = "updated"  # same tensors, new values (version counters moved): cached K/V is stale
    REPLACED = "replaced"  # a tensor replaced, moved or re-typed: fused weights and graphs are stale


class StaleWeightsError(RuntimeError):
    """Raised by ``LLMEngine.attach`` when a parameter or buffer of the model was replaced since the engine last
    saw it (its fused weights and CUDA graphs read the old tensors): close the engine and build a new one."""


def _version(tensor: torch.Tensor) -> int | None:
    # inference tensors (a buffer recomputed under inference_mode) have no version counter
    return None if tensor.is_inference() else tensor._version


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter and buffer, each tensor once, module by module. One walk of the module
    tree (``named_parameters`` plus ``named_buffers`` would walk it twice, each more slowly)."""
    seen = set()
    for prefix, module in model.named_modules():
        for name, tensor in itertools.chain(module._parameters.items(), module._buffers.items()):
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                yield (f"{prefix}.{name}" if prefix else name), tensor


def _entries(model: torch.nn.Module) -> tuple:
    return tuple((id(t), t.data_ptr(), _version(t), t.device, t.dtype, t.shape) for _, t in _tensors(model))


@dataclass(frozen=True, slots=True)
class WeightsSnapshot:
    """``(id, data_ptr, version, device, dtype, shape)`` of every parameter and buffer, module by module.

    Taking one walks the module tree once (about 1 ms for a 30-layer model on CPU).
    """

    entries: tuple

    @classmethod
    def take(cls, model: torch.nn.Module) -> "WeightsSnapshot":
        """The snapshot of ``model`` now."""
        return cls(_entries(model))

    def compare(self, model: torch.nn.Module) -> tuple[WeightsChange, str]:
        """How ``model``'s tensors differ from this snapshot.

        Returns:
            ``(change, detail)``: ``detail`` names the first tensor that changed and how ('' when nothing did).
        """
        now = _entries(model)
        if now == self.entries:
            return WeightsChange.NONE, ""
        names = [name for name, _ in _tensors(model)]
        if len(now) != len(self.entries):
            return WeightsChange.REPLACED, f"the model has {len(now)} parameters and buffers, {len(self.entries)} before"
        fields = ("object", "storage address", "version", "device", "dtype", "shape")
        updated = ""
        for name, old, new in zip(names, self.entries, now):
            for field, a, b in zip(fields, old, new):
                if a == b:
                    continue
                if field != "version":
                    return WeightsChange.REPLACED, f"{name}: {field} changed" + (f" ({a} -> {b})" if field in fields[3:] else "")
                updated = updated or f"{name}: written in place"
        return WeightsChange.UPDATED, updated
