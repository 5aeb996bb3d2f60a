"""Position-weighted checksums of int32 word arrays: ``checksums`` (one Triton launch over every array) and its
reference ``checksums_ref`` (PyTorch, chunked). The engine's weight-change check (``core/weights.py``) runs them
over the raw bytes of the model's tensors once per call.

The checksum of words ``w_0 .. w_{n-1}`` (int32, sign-extended) is ``sum(w_i * (i * K + 1)) mod 2**64`` as an
int64, with ``K = 2 * 0x9E3779B97F4A7C15`` (twice the 64-bit golden-ratio constant of Knuth's multiplicative
hashing, so every weight ``i * K + 1`` is odd and weights of nearby positions differ in their high bits). What it
sees:

- any change of one word: the sum moves by ``d * (odd weight)``, and ``|d| < 2**32`` is never a multiple of
  ``2**64``, so a single changed element (a sign flip, one bit) always changes the checksum;
- permutations: swapping words ``a`` and ``b`` moves it by ``(w_a - w_b) * (i_a - i_b) * K``, zero modulo
  ``2**64`` only when the trailing zero bits of the three factors add up to 64 (the first has at most 31, ``K``
  one: the positions would have to be ``2**32`` words apart);
- other changes are missed with probability about ``2**-64`` for changes unrelated to the weights (a linear hash:
  not a cryptographic one, nobody is expected to forge a collision).

A plain sum or norm sees neither a permutation nor, for floats read as values, many bit-level changes.

Why a kernel: the engine checks every weight at every call, so the check must run at memory bandwidth in one
launch (16 GB of an 8B bf16 model at about 3 TB/s: 5 ms), with no temporaries of the arrays' size. PyTorch's
integer ops take three passes over an int64 copy of every word (``checksums_ref``, used on the CPU).
"""

from dataclasses import dataclass

import torch

from .._launch import load_triton_kernels

BLOCK = 1024  # words per iteration of a program
CHUNK = 64 * BLOCK  # words per program: 256 KiB
REF_CHUNK = 1 << 16  # words per piece of the reference


def _s64(value: int) -> int:
    """``value`` modulo 2**64 as a signed int64."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


K = _s64(2 * 0x9E3779B97F4A7C15)  # the position weights' multiplier, as a signed int64 (even)


def _check_words(words: list[torch.Tensor]) -> torch.device:
    """Raises ValueError unless ``words`` is a non-empty list of 1-D contiguous int32 tensors on one device.
    Returns that device."""
    if not isinstance(words, (list, tuple)) or not words:
        raise ValueError(f"words must be a non-empty list of int32 tensors, got {type(words).__name__}")
    device = words[0].device
    for i, w in enumerate(words):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.int32 or w.dim() != 1 or not w.is_contiguous():
            what = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"words[{i}] must be a 1-D contiguous int32 tensor, got {what}")
        if w.device != device:
            raise ValueError(f"words[{i}] is on {w.device}, words[0] on {device}: one device per call")
    return device


def checksums_ref(words: list[torch.Tensor], chunk: int = REF_CHUNK) -> torch.Tensor:
    """The checksum of each array (see the module docstring), with PyTorch ops on the arrays' device.

    Each piece of ``chunk`` words starting at word ``s`` gets its weights as one add to a fixed table
    (``j * K + 1``, plus ``s * K``), then one multiply and one sum: three passes over ``chunk`` int64s.

    Args:
        words: 1-D contiguous int32 tensors on one device.
        chunk: words per piece; the temporaries are two ``[chunk]`` int64 tensors.

    Returns:
        ``[len(words)]`` int64 on that device.

    Raises:
        ValueError: ``words`` not as above, or ``chunk`` not a positive int.
    """
    device = _check_words(words)
    if type(chunk) is not int or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    table = torch.arange(chunk, dtype=torch.int64, device=device) * K + 1  # [chunk]: j * K + 1
    scratch = torch.empty(chunk, dtype=torch.int64, device=device)
    out = torch.zeros(len(words), dtype=torch.int64, device=device)
    for a, w in enumerate(words):
        for start in range(0, w.numel(), chunk):
            piece = w[start: start + chunk]
            weights = torch.add(table[: piece.numel()], _s64(start * K), out=scratch[: piece.numel()])
            out[a] += weights.mul_(piece).sum()  # int32 words promoted to int64: sign-extended
    return out


@dataclass(frozen=True)
class ChunkTable:
    """How ``checksums`` splits its arrays into programs: per chunk, the address of its array's first word, its first
    word's index in the array, its length, and which array it belongs to. Valid for arrays at the same addresses
    with the same lengths (``key``); build one with ``chunk_table`` and keep it while they stay.

    Attributes:
        key: ``((data_ptr, numel), ...)`` of the arrays it was built for.
        chunk: words per chunk (a power of two); each array's last chunk may be shorter.
        bases, starts, lengths, owners: ``[num_chunks]`` int64 on the arrays' device.
    """

    key: tuple
    chunk: int
    bases: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    owners: torch.Tensor


def table_key(words: list[torch.Tensor]) -> tuple:
    """``((data_ptr, numel), ...)`` of ``words``: a ``ChunkTable`` built for equal keys reads the same memory."""
    return tuple((w.data_ptr(), w.numel()) for w in words)


def chunk_table(words: list[torch.Tensor], chunk: int = CHUNK) -> ChunkTable:
    """The ``ChunkTable`` of ``words`` (empty arrays get no chunk), made on the host and copied to their device once.

    Args:
        words: 1-D contiguous int32 tensors on one device.
        chunk: words per program, a power of two from 16 to 2**24 (``CHUNK`` unless testing).

    Raises:
        ValueError: ``words`` not as above; ``chunk`` out of range.
    """
    device = _check_words(words)
    if type(chunk) is not int or not 16 <= chunk <= 1 << 24 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two in [16, 2**24], got {chunk!r}")
    key = table_key(words)
    sizes = torch.tensor([n for _, n in key], dtype=torch.int64)
    counts = (sizes + chunk - 1) // chunk  # [A]
    owners = torch.repeat_interleave(torch.arange(len(words)), counts)  # [C]
    first = torch.cumsum(counts, 0) - counts  # [A]: each array's first chunk
    starts = (torch.arange(owners.numel()) - first[owners]) * chunk
    lengths = torch.minimum(sizes[owners] - starts, torch.tensor(chunk))
    bases = torch.tensor([p for p, _ in key], dtype=torch.int64)[owners]
    return ChunkTable(key, chunk, *(t.to(device) for t in (bases, starts, lengths, owners)))


def checksums(words: list[torch.Tensor], table: ChunkTable | None = None) -> torch.Tensor:
    """``checksums_ref(words)`` in one Triton launch over every array (CUDA, or the interpreter on the CPU), plus one
    ``index_add_`` of the chunks' sums. Nothing is read back to the host.

    Args:
        words: 1-D contiguous int32 tensors on one device (each 4-byte aligned, as int32 tensors are).
        table: ``chunk_table(words)``, kept by a caller that checks the same arrays again; None builds it.

    Returns:
        ``[len(words)]`` int64 on the arrays' device.

    Raises:
        ValueError: ``words`` not as above; ``table`` built for other arrays (another ``table_key``).
        RuntimeError: CPU tensors without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    device = _check_words(words)
    if table is None:
        table = chunk_table(words)
    elif table.key != table_key(words):
        raise ValueError("table was built for other arrays (addresses or lengths differ); build it again")
    out = torch.zeros(len(words), dtype=torch.int64, device=device)
    num_chunks = table.owners.numel()
    if num_chunks == 0:
        return out
    kernels = load_triton_kernels("checksum.triton_kernels", device)
    partial = torch.empty(num_chunks, dtype=torch.int64, device=device)
    block = min(BLOCK, table.chunk)
    kernels._checksum_chunk_kernel[(num_chunks,)](table.bases, table.starts, table.lengths, partial, K=K,
                                                  BLOCK=block, ITERS=table.chunk // block, num_warps=4)
    return out.index_add_(0, table.owners, partial)
