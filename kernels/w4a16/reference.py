"""The packed weight layout in PyTorch: pack / unpack, exact dequantization, and ``w4a16_matmul_ref``, the reference
of ``w4a16_matmul`` and the CPU path of ``QuantLinear`` (layout in the package docstring)."""

import torch


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpack an int32 tensor packed along dim 0, low bits first.

    Args:
        packed: int32 ``[R, C]``.
        bits: 4 or 8.

    Returns:
        int32 ``[R * (32 // bits), C]`` with values in ``[0, 2**bits)``; row ``r * pack + j`` is bits
        ``[bits * j, bits * (j + 1))`` of ``packed[r]``.
    """
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32).view(1, pack, 1)
    q = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [R, pack, C]
    return q.reshape(packed.shape[0] * pack, packed.shape[1])


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``unpack_rows``: pack integer values ``[K, C]`` (``K % (32 // bits) == 0``) into
    int32 ``[K // (32 // bits), C]`` along dim 0, low bits first.

    Raises:
        ValueError: ``K`` is not a multiple of ``32 // bits``.
    """
    pack = 32 // bits
    if q.shape[0] % pack:
        raise ValueError(f"cannot pack {q.shape[0]} rows into int32 words of {pack} values")
    shifts = torch.arange(0, 32, bits, device=q.device, dtype=torch.int64).view(1, pack, 1)
    words = (q.to(torch.int64).view(-1, pack, q.shape[1]) << shifts).sum(dim=1)  # [K/pack, C], in [0, 2**32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as two's-complement int32
    return words.to(torch.int32)


def dequantize_packed(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """The full weight of the packed layout (see the package docstring), exactly, in float32.

    Args:
        qweight: int32 ``[K // pack, N]``; scales ``[G, N]`` any float dtype; zeros int ``[G, N]``.
        bits: 4 or 8. group_size: rows per group (``K`` for per-channel).

    Returns:
        float32 ``[K, N]``: ``(q - zeros[k // group_size]) * scales[k // group_size]``.
    """
    q = unpack_rows(qweight, bits)  # [K, N]
    K, N = q.shape
    G = K // group_size
    w = (q.view(G, group_size, N) - zeros.view(G, 1, N)).to(torch.float32)  # broadcast per group, no gather
    return (w * scales.view(G, 1, N).to(torch.float32)).view(K, N)


def w4a16_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference of ``w4a16_matmul`` (and the CPU path): dequantize, then matmul.

    The weight is dequantized exactly in float32 and cast to ``x.dtype`` before the matmul, which is
    also what the Triton kernel feeds its tensor cores; for float32 ``x`` the result is the exact
    dequantized model.

    Args:
        x: ``[M, K]`` float (any float dtype). Other args as in ``w4a16_matmul``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    w = dequantize_packed(qweight, scales, zeros, bits, group_size).to(x.dtype)
    out = x @ w
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out
