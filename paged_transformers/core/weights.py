"""What changed in a model's parameters and buffers since the engine last saw them: values written in place, or
tensors replaced.

A warm engine (``warm.py``) outlives calls, and between calls the model is the user's: an optimizer step,
``load_state_dict`` or a merged adapter changes the weights the next call must compute with. The engine checks once
per call, when it is attached, with two records:

- ``WeightsSnapshot`` (taken at ``detach``): ``(id, data_ptr, version, device, dtype, shape)`` of every tensor.
  **Replaced**: a tensor is another object, at another address, or of another device, dtype or shape
  (``param.data = ...``, a new ``nn.Parameter``, ``model.to(...)``, ``model.half()``, a wrapped module): the
  engine's fused weights and captured graphs still read the old storage, so the engine must be rebuilt. A moved
  version counter (``param.add_``, ``optimizer.step()``, ``load_state_dict``) counts as updated.
- ``WeightsFingerprint`` (taken at every ``attach``, compared with the previous attach's): a position-weighted
  checksum of the raw bytes of every tensor's storage (``kernels.checksum``), on the tensors' own device.
  **Updated**: the same tensors hold other values. It sees what the version counters miss: writes through
  ``.data`` (``param.data.add_``, ``param.data.copy_``, ``torch.nn.init.*_(param.data)``, peft's
  ``merge_and_unload``, which adds its delta to ``weight.data``) and fused optimizers (``torch.optim.AdamW(fused=True)``,
  the default optimizer of the HF Trainer and TRL, and ``Adam(fused=True)`` leave ``_version`` at 0). One read of
  every weight per call: one Triton launch on CUDA (the 16 GB of an 8B bf16 model read at memory bandwidth: about
  5 ms; ``benchmarks/bench_weight_check.py``), chunked PyTorch int64 ops on the CPU (about four times a plain
  ``sum()`` over the same bytes). Each storage is read once, so the views of the fused projections and tied weights
  cost nothing more.

On an update the engine computes with live weights (its fused projections and CUDA graphs read the same storage),
but K/V cached from the old weights is stale, so the prefix cache is dropped, and so is every copy derived from the
weights (``runner.weights_changed``: the packed CPU weights, ``QuantLinear``'s dequantized CPU weights).
"""

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..kernels.checksum import checksums, checksums_ref, chunk_table, table_key


class WeightsChange(enum.Enum):
    """How a model's tensors differ from a snapshot."""

    NONE = "none"
    UPDATED = "updated"  # same tensors, new values (a version counter moved or a checksum changed): cached K/V is stale
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

    Taking one walks the module tree once and reads no tensor's data, so it is cheap next to a checksum.
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


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """The bytes of ``tensor``'s whole storage as a ``[nbytes]`` uint8 view. None for a tensor without data (meta,
    empty, or a subclass without a storage of its own)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    nbytes = storage.nbytes()
    if tensor.device.type == "meta" or nbytes == 0:
        return None
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (nbytes,), (1,))


def _words(raw: torch.Tensor) -> torch.Tensor:
    """``[nbytes]`` uint8 as ``[ceil(nbytes / 4)]`` int32 words: a view, or a zero-padded copy (made again at each
    call, so that it holds the current bytes) when the size or the address is not a multiple of 4 bytes."""
    if raw.numel() % 4 or raw.data_ptr() % 4:
        raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 4)])
    return raw.view(torch.int32)


@dataclass(frozen=True, slots=True)
class WeightsFingerprint:
    """A checksum of the bytes of every storage that holds a parameter or buffer (``kernels.checksum``), storage by
    storage in module order, each named by the first tensor found on it.

    Attributes:
        names: per storage, the name of its first tensor.
        sums: per storage, its checksum (an int).
        tables: per CUDA device, the ``ChunkTable`` of its storages (reused by the next ``take`` while they stay).
        storages: per device, ``(index into names, [nbytes] uint8 view of the storage)`` of its storages: what
            ``again`` reads without walking the model.
    """

    names: tuple
    sums: tuple
    tables: dict
    storages: dict

    @classmethod
    @torch.no_grad()
    def take(cls, model: torch.nn.Module, previous: "WeightsFingerprint | None" = None) -> "WeightsFingerprint":
        """The fingerprint of ``model`` now: one read of its weights, one host sync per device. ``previous`` lends
        its chunk tables where the storages are the same."""
        seen, names, per_device = set(), [], {}
        for name, tensor in _tensors(model):
            raw = _storage_bytes(tensor)
            if raw is None or (tensor.device, raw.data_ptr()) in seen:
                continue
            seen.add((tensor.device, raw.data_ptr()))
            names.append(name)
            per_device.setdefault(tensor.device, []).append((len(names) - 1, raw))
        return cls._of(tuple(names), per_device, previous)

    @torch.no_grad()
    def again(self) -> "WeightsFingerprint":
        """The fingerprint of the same storages now, without walking the model: for a caller that has checked (with
        a ``WeightsSnapshot``) that every parameter and buffer is the same tensor at the same address. On CUDA one
        launch per device over the kept chunk table and one read back: the cost is the read of the weights."""
        return type(self)._of(self.names, self.storages, self)

    @classmethod
    def _of(cls, names: tuple, per_device: dict, previous: "WeightsFingerprint | None") -> "WeightsFingerprint":
        sums, tables = [0] * len(names), {}
        for device, entries in per_device.items():
            words = [_words(raw) for _, raw in entries]
            for (i, _), value in zip(entries, _checksums(words, device, previous, tables).tolist()):
                sums[i] = value
        return cls(names, tuple(sums), tables, per_device)

    def compare(self, now: "WeightsFingerprint") -> str:
        """'' when ``now`` has the same checksums, else the first tensor whose storage's checksum changed (or why
        the two cannot be compared)."""
        if self.names != now.names:
            return f"the tensors' storages differ ({len(self.names)} before, {len(now.names)} now)"
        for name, a, b in zip(self.names, self.sums, now.sums):
            if a != b:
                return f"{name}: values changed in place (checksum)"
        return ""


def _checksums(words: list[torch.Tensor], device: torch.device, previous: "WeightsFingerprint | None",
               tables: dict) -> torch.Tensor:
    """``checksums`` of ``words`` on CUDA (one launch, the chunk table reused from ``previous`` when it fits, and put
    in ``tables``), ``checksums_ref`` elsewhere."""
    if device.type != "cuda":
        return checksums_ref(words)
    table = previous.tables.get(device) if previous is not None else None
    if table is None or table.key != table_key(words):
        table = chunk_table(words)
    tables[device] = table
    return checksums(words, table)
