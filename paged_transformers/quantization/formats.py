"""Decode GPTQ v1 and AWQ GEMM checkpoint tensors, and convert them to the kernel's packed layout.

Checkpoint layouts (checked bit for bit against the fixtures' ``layer0_dequant_fp32.safetensors``;
``pack = 32 // bits`` values per int32, low bits first)::

    GPTQ v1   qweight int32 [in/pack, out]   packed along IN:  q[i,o] = qweight[i//pack, o] >> bits*(i%pack)
              qzeros  int32 [G, out/pack]    packed along OUT, stores zero-1: z[g,o] = field(o) + 1
              scales  fp16  [G, out]         g_idx int32 [in]: the group of input row i
              W[o,i] = scales[g_idx[i], o] * (q[i,o] - z[g_idx[i], o])
    AWQ gemm  qweight int32 [in, out/8]      packed along OUT with AWQ's interleave: nibble j of word w
              qzeros  int32 [in/G, out/8]    is column 8w + [0,2,4,6,1,3,5,7][j]; zeros stored as is
              scales  fp16  [in/G, out]      W[o,i] = scales[i//G, o] * (q[i,o] - z[i//G, o])

Kernel layout (``paged_transformers.kernels.w4a16``): ``qweight int32 [in/pack, out]`` packed along
IN (GPTQ's), ``scales [G, out]`` (kept in the checkpoint dtype), ``zeros int16 [G, out]``, and for
act-order an input permutation ``perm [in]`` such that row ``k`` of the kernel weight is input
feature ``perm[k]`` and groups are contiguous: ``group(k) = k // group_size``.

Sources: GPTQModel 7.6 / AutoGPTQ ``pack``/``dequantize_weight`` (v1 zero-1 convention), AutoAWQ
0.2.9 ``packing_utils`` (``AWQ_ORDER``), as documented in the fixtures' README (section 4).
"""

from dataclasses import dataclass

import torch

from ..kernels.w4a16 import pack_rows, unpack_rows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column 8*word + AWQ_ORDER[j]


@dataclass(slots=True)
class PackedWeight:
    """One linear layer in the kernel layout (see the module docstring).

    Attributes:
        qweight: int32 ``[in_features // pack, out_features]``.
        scales: ``[n_groups, out_features]``, the checkpoint's float dtype.
        zeros: int16 ``[n_groups, out_features]``.
        perm: int64 ``[in_features]`` act-order input permutation, or None when groups are already
            contiguous (``g_idx[i] == i // group_size``).
        bits: 4 or 8. group_size: rows per group, ``in_features`` for per-channel.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    bits: int
    group_size: int


def unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unpack an int32 tensor packed along dim 1 (``[R, C]`` -> int32 ``[R, C * pack]``).

    Args:
        packed: int32 ``[R, C]``.
        bits: 4 or 8.
        order: for AWQ, ``order[j]`` is the column (within the word's ``pack`` columns) held by
            field ``j``; None means field ``j`` holds column ``j``.
    """
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, pack]: field j
    if order is not None:
        inverse = torch.argsort(torch.tensor(order, device=packed.device))  # column t <- field inverse[t]
        fields = fields[..., inverse]
    return fields.reshape(packed.shape[0], packed.shape[1] * pack)


def gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ v1 ``qweight [in/pack, out]``, ``qzeros [G, out/pack]`` -> ``q int32 [in, out]``, ``zeros int32 [G, out]``.

    v1 stores ``zero - 1``; the +1 is applied without wrap-around (as AutoGPTQ and exllama read v1),
    so a stored ``2**bits - 1`` reads as ``2**bits``.
    """
    return unpack_rows(qweight, bits), unpack_cols(qzeros, bits) + 1


def dequantize_gptq(qweight, qzeros, scales, g_idx, bits: int) -> torch.Tensor:
    """Reference dequantization of a GPTQ v1 layer: float32 ``W [out, in]`` (exact).

    Args:
        qweight: int32 ``[in/pack, out]``; qzeros int32 ``[G, out/pack]``; scales ``[G, out]``;
        g_idx: int ``[in]``. bits: 4 or 8.
    """
    q, z = gptq_unpack(qweight, qzeros, bits)
    g = g_idx.long()
    return ((q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]).t()


def dequantize_awq(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """Reference dequantization of an AWQ GEMM layer: float32 ``W [out, in]`` (exact).

    Args:
        qweight: int32 ``[in, out/8]``; qzeros int32 ``[in/group_size, out/8]``; scales ``[in/group_size, out]``.
    """
    q = unpack_cols(qweight, 4, AWQ_ORDER)
    z = unpack_cols(qzeros, 4, AWQ_ORDER)
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return ((q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]).t()


# Values a conversion chunk unpacks: its temporaries (int64 in ``pack_rows``) stay within a few times 32 MiB
CHUNK_VALUES = 1 << 22


def _pack_rows_chunked(rows, K: int, N: int, bits: int, device: torch.device) -> torch.Tensor:
    """The kernel layout's qweight, int32 ``[K // pack, N]``, from ``rows(k0, k1)`` (the integer values ``[k1 - k0,
    N]`` of kernel rows ``k0 .. k1``), packed ``CHUNK_VALUES`` values at a time into an output allocated first.

    Unpacked whole, each of a layer's ``[K, N]`` temporaries takes 8x (int32) or 16x (int64) its packed bytes, about
    1.2-1.5 GB together for a 4096 x 14336 layer. On CUDA, where a model is converted layer by layer, the caching
    allocator keeps those freed blocks and splits the next layers' weights out of them, and the reserved memory they
    pin is memory the KV cache does not get (the pool is sized from the device's free memory, ``core.sizing``).

    Raises:
        ValueError: ``K`` not a multiple of ``32 // bits``.
    """
    pack = 32 // bits
    if K % pack:
        raise ValueError(f"cannot pack {K} rows into int32 words of {pack} values")
    out = torch.empty(K // pack, N, dtype=torch.int32, device=device)
    step = max(pack, CHUNK_VALUES // max(N, 1) // pack * pack)
    for k0 in range(0, K, step):
        k1 = min(K, k0 + step)
        out[k0 // pack:k1 // pack] = pack_rows(rows(k0, k1), bits)
    return out


def gptq_to_kernel_layout(qweight, qzeros, scales, g_idx, bits: int, group_size: int) -> PackedWeight:
    """Convert one GPTQ v1 layer to the kernel layout, reordering act-order input rows once.

    Args:
        qweight, qzeros, scales, g_idx: the checkpoint tensors (shapes in the module docstring);
            ``g_idx`` may be None (then ``i // group_size``).
        bits: 4 or 8. group_size: the config's, -1 for per channel.

    Raises:
        NotImplementedError: ``g_idx`` groups that do not all hold exactly ``group_size`` rows
            (cannot be made contiguous by a permutation).
    """
    z = unpack_cols(qzeros, bits) + 1  # [G, N]
    K = qweight.shape[0] * (32 // bits)
    gs = K if group_size == -1 else group_size
    expected = torch.arange(K, device=qweight.device) // gs
    if g_idx is None or torch.equal(g_idx.to(expected.dtype), expected):
        # groups already contiguous: GPTQ's qweight is the kernel layout as is
        return PackedWeight(qweight.contiguous(), scales.contiguous(), z.to(torch.int16), None, bits, gs)
    # act-order: sort the input rows by group (stable), so group(k) = k // gs in the kernel
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], expected):
        raise NotImplementedError(f"g_idx with groups of unequal size (group_size={group_size}) is not supported")
    pack, mask = 32 // bits, (1 << bits) - 1

    def rows(k0, k1):  # kernel rows k0..k1: input rows perm[k0:k1], read from their words
        p = perm[k0:k1]
        return (qweight[p // pack] >> (bits * (p % pack)).to(torch.int32).unsqueeze(1)) & mask

    return PackedWeight(_pack_rows_chunked(rows, K, qweight.shape[1], bits, qweight.device), scales.contiguous(),
                        z.to(torch.int16), perm, bits, gs)


def awq_to_kernel_layout(qweight, qzeros, scales, group_size: int) -> PackedWeight:
    """Convert one AWQ GEMM layer (4-bit) to the kernel layout (shapes in the module docstring), a chunk of input rows
    at a time (``_pack_rows_chunked``).

    Raises:
        ValueError: ``in_features`` (qweight's rows) not a multiple of 8.
    """
    K, N = qweight.shape[0], qweight.shape[1] * 8
    z = unpack_cols(qzeros, 4, AWQ_ORDER)  # [G, N]
    gs = K if group_size == -1 else group_size
    qw = _pack_rows_chunked(lambda k0, k1: unpack_cols(qweight[k0:k1], 4, AWQ_ORDER), K, N, 4, qweight.device)
    return PackedWeight(qw, scales.contiguous(), z.to(torch.int16), None, 4, gs)
