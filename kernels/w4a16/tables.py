"""The W4A16 tuning tables: per-device JSON files of launch configurations (``configs/<device name>.json``, the
device name as ``torch.cuda.get_device_name`` gives it with spaces as underscores, as vLLM keeps its fused-MoE
configs), written by the research sweep (``research/w4a16_tables.py``); which table a device gets
(``table_for_device``: its own, else the one of its compute capability measured on the closest SM count); and the
rule used on a device that gets none.

A table file::

    {
      "device_name": "NVIDIA H100 80GB HBM3",     the device it is for (the file name, spaces as underscores)
      "num_sms": 132, "compute_capability": [9, 0],
      "measured_on": "...", "versions": {"torch": "...", "triton": "..."},   where and with what it was measured
      "generated_by": "...",                       the command that wrote it
      "buckets": [                                 one per weight shape (``dispatch.weight_shape``) and row range
        {"shape": "tall", "min_m": 17, "max_m": 32, "candidates": [
          {"algo": "wgmma", "block_m": 32, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4,
           "split_k_rule": "fixed", "split_k": 4, "one_wave": false},
          {"algo": "tc", ..., "split_k_rule": "programs_per_sm", "programs_per_sm": 2, "one_wave": false},
          ...]},
        ...]
    }

The candidates of a bucket are in order of preference: the fastest the sweep found first, then the configs to use
where it cannot run (another group size, 8 bits, fp32 x, no Gluon, unaligned tensors). ``split_k_rule`` says how the
split-K count is set: ``"fixed"``, ``split_k`` lowered to the largest power of two that divides the K steps and
leaves each slice at least 2 K steps a consumer warpgroup; ``"programs_per_sm"``, ``split_k_for`` on the device's SM
count. ``one_wave``: the candidate applies only where its grid is at most one program an SM (where two programs
share some SMs and not others, those SMs set the time).
"""

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from importlib import resources

import torch

SHAPES = ("square", "wide", "tall")
SPLIT_K_RULES = ("fixed", "programs_per_sm")
logger = logging.getLogger("paged_transformers")

_CONFIG_FIELDS = ("algo", "block_m", "block_n", "block_k", "num_warps", "num_stages")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One launch configuration of a bucket (the module docstring): the ``W4A16Config`` fields but ``split_k``, and
    how the split-K count is set."""

    algo: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k_rule: str
    split_k: int = 1  # the "fixed" rule's count
    programs_per_sm: int = 0  # the "programs_per_sm" rule's target
    one_wave: bool = False

    def __post_init__(self):
        if self.split_k_rule not in SPLIT_K_RULES:
            raise ValueError(f"split_k_rule must be one of {SPLIT_K_RULES}, got {self.split_k_rule!r}")
        if self.split_k_rule == "programs_per_sm" and self.programs_per_sm < 1:
            raise ValueError(f"split_k_rule 'programs_per_sm' needs programs_per_sm >= 1, got {self.programs_per_sm}")
        if self.split_k_rule == "fixed" and self.split_k < 1:
            raise ValueError(f"split_k_rule 'fixed' needs split_k >= 1, got {self.split_k}")
        if (self.split_k_rule == "fixed" and self.programs_per_sm) or (self.split_k_rule != "fixed" and self.split_k != 1):
            raise ValueError(f"split_k_rule {self.split_k_rule!r} takes only its own count (split_k for 'fixed', "
                             f"programs_per_sm for 'programs_per_sm'), got split_k={self.split_k}, "
                             f"programs_per_sm={self.programs_per_sm}")

    def to_json(self) -> dict:
        """The candidate as a table entry: the fields its ``split_k_rule`` uses, nothing else."""
        entry = {name: getattr(self, name) for name in _CONFIG_FIELDS}
        entry["split_k_rule"] = self.split_k_rule
        if self.split_k_rule == "fixed":
            entry["split_k"] = self.split_k
        else:
            entry["programs_per_sm"] = self.programs_per_sm
        entry["one_wave"] = self.one_wave
        return entry

    @classmethod
    def from_json(cls, entry: dict) -> "Candidate":
        """A table entry as a ``Candidate``. Raises ValueError (naming the entry) on an unknown or missing field."""
        allowed = set(_CONFIG_FIELDS) | {"split_k_rule", "split_k", "programs_per_sm", "one_wave"}
        if set(entry) - allowed or not set(_CONFIG_FIELDS) | {"split_k_rule"} <= set(entry):
            raise ValueError(f"bad W4A16 table candidate {entry}: fields {sorted(allowed)}, all but split_k / "
                             "programs_per_sm (the one its split_k_rule uses) and one_wave required")
        return cls(**entry)


@dataclass(frozen=True, slots=True)
class Bucket:
    """The candidates for weights of ``shape`` at ``min_m <= M <= max_m`` rows, in order of preference."""

    shape: str
    min_m: int
    max_m: int
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True, slots=True)
class Table:
    """One device's table (the module docstring has the file format); ``header``: its other fields, as read."""

    device_name: str
    buckets: tuple[Bucket, ...]
    header: dict = dataclasses.field(default_factory=dict, compare=False)

    def candidates(self, shape: str, M: int) -> tuple[Candidate, ...]:
        """The candidates of the bucket for ``shape`` and ``M``, or ``()`` where the table has none."""
        for bucket in self.buckets:
            if bucket.shape == shape and bucket.min_m <= M <= bucket.max_m:
                return bucket.candidates
        return ()

    def to_json(self) -> dict:
        """The table as its file's JSON object."""
        return {"device_name": self.device_name, **self.header,
                "buckets": [{"shape": b.shape, "min_m": b.min_m, "max_m": b.max_m,
                             "candidates": [c.to_json() for c in b.candidates]} for b in self.buckets]}

    @classmethod
    def from_json(cls, data: dict) -> "Table":
        """A table from its file's JSON object.

        Raises:
            ValueError: a missing field, an unknown shape, an empty or inverted row range, buckets of one shape that
                overlap, or a bad candidate (``Candidate.from_json``).
        """
        buckets = []
        for b in data.get("buckets", ()):
            if b.get("shape") not in SHAPES or not 1 <= b.get("min_m", 0) <= b.get("max_m", 0) or not b.get("candidates"):
                raise ValueError(f"bad W4A16 table bucket (shape one of {SHAPES}, 1 <= min_m <= max_m, candidates): "
                                 f"{ {k: v for k, v in b.items() if k != 'candidates'} }")
            buckets.append(Bucket(b["shape"], b["min_m"], b["max_m"], tuple(map(Candidate.from_json, b["candidates"]))))
        for shape in SHAPES:
            ranges = sorted((b.min_m, b.max_m) for b in buckets if b.shape == shape)
            if any(lo <= prev_hi for (_, prev_hi), (lo, _) in zip(ranges, ranges[1:])):
                raise ValueError(f"W4A16 table buckets of shape {shape} overlap: {ranges}")
        if "device_name" not in data:
            raise ValueError("a W4A16 table needs device_name")
        header = {k: v for k, v in data.items() if k not in ("device_name", "buckets")}
        return cls(data["device_name"], tuple(buckets), header)


def file_name(device_name: str) -> str:
    """The table file of a device: ``"NVIDIA H100 80GB HBM3"`` -> ``"NVIDIA_H100_80GB_HBM3.json"``."""
    return device_name.replace(" ", "_") + ".json"


@functools.lru_cache(maxsize=None)
def table_named(device_name: str) -> Table | None:
    """The shipped table of the device called ``device_name``, or None when there is none."""
    path = resources.files(__package__).joinpath("configs", file_name(device_name))
    if not path.is_file():
        return None
    return Table.from_json(json.loads(path.read_text()))


@functools.lru_cache(maxsize=None)
def shipped_tables() -> tuple[Table, ...]:
    """Every shipped table, in file name order (read once)."""
    configs = resources.files(__package__).joinpath("configs")
    paths = sorted((p for p in configs.iterdir() if p.name.endswith(".json")), key=lambda p: p.name)
    return tuple(Table.from_json(json.loads(p.read_text())) for p in paths)


@functools.lru_cache(maxsize=None)
def table_for_device(device_name: str, capability: tuple[int, int], num_sms: int) -> Table | None:
    """The table for a GPU called ``device_name`` of compute ``capability`` with ``num_sms`` SMs, as vLLM's fused-MoE
    config lookup degrades: the device's own table; else, among the shipped tables whose ``compute_capability`` is
    ``capability`` (the same kernels run, WGMMA included on sm_90), the one measured on the closest SM count (ties:
    the first by file name), so every sm_90 GPU gets a Hopper table and its WGMMA configs; else None (the fallback
    rule). Split-K counts are then computed on the device's own SM count (``dispatch._config``). Logs the
    choice at INFO once per device (cached)."""
    own = table_named(device_name)
    if own is not None:
        logger.info("paged_transformers: W4A16 uses the tuning table of %s", device_name)
        return own
    same = [t for t in shipped_tables() if tuple(t.header.get("compute_capability", ())) == tuple(capability)]
    if not same:
        logger.info("paged_transformers: no W4A16 tuning table for %s (sm_%d%d): the fallback rule, no WGMMA",
                    device_name, *capability)
        return None
    nearest = min(same, key=lambda t: abs(t.header.get("num_sms", 0) - num_sms))
    logger.info("paged_transformers: no W4A16 tuning table for %s (sm_%d%d, %d SMs): using the one of %s, the same "
                "compute capability on the closest SM count (%s); split-K is computed for %d SMs", device_name,
                *capability, num_sms, nearest.device_name, nearest.header.get("num_sms"), num_sms)
    return nearest


@functools.lru_cache(maxsize=None)
def table_for(device: torch.device) -> Table | None:
    """The table of ``device``: a CUDA device's by ``table_for_device``, None off CUDA (cached: the dispatch asks at
    every call)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    return table_for_device(props.name, (props.major, props.minor), props.multi_processor_count)


def _fixed(algo, block_m, block_n, block_k, num_warps, num_stages) -> Candidate:
    return Candidate(algo, block_m, block_n, block_k, num_warps, num_stages, "fixed")


def _per_sm(programs_per_sm, algo, block_m, block_n, block_k, num_warps, num_stages) -> Candidate:
    return Candidate(algo, block_m, block_n, block_k, num_warps, num_stages, "programs_per_sm",
                     programs_per_sm=programs_per_sm)


# The rule for devices without a table, correct everywhere: each list ends in a kernel that runs any layer (DOT, or
# DEQUANT_MATMUL), so every call gets a config. The GEMV at one row; the tensor-core kernel up to 64 rows where it
# applies (CUDA, 4 bits, fp16/bf16 x, every K step in one group), DOT up to 16 rows elsewhere; above, the weight
# dequantized for cuBLAS. No WGMMA: its configs are tuned per device.
_GEMV = _per_sm(8, "gemv", 1, 512, 64, 2, 1)
_TC_SMALL = _per_sm(4, "tc", 16, 64, 128, 4, 3)
_TC_LARGE = _per_sm(2, "tc", 64, 128, 128, 8, 3)
_DOT = _per_sm(4, "dot", 16, 64, 128, 4, 3)
_DEQUANT_MATMUL = _fixed("dequant_matmul", 128, 128, 128, 4, 3)


def fallback_candidates(M: int) -> tuple[Candidate, ...]:
    """The candidates of the rule for devices without a table (the comment above), for ``M`` rows."""
    if M == 1:
        return (_GEMV, _TC_SMALL, _DOT)
    if M <= 16:
        return (_TC_SMALL, _DOT)
    if M <= 64:
        return (_TC_LARGE, _DEQUANT_MATMUL)
    return (_DEQUANT_MATMUL,)
