"""The elementwise ops of a Llama-family decoder layer between its projections, as Triton kernels, with their
PyTorch references (transformers' own code: ``LlamaRMSNorm``, ``apply_rotary_pos_emb``, ``silu(gate) * up``).

| function (Triton) / reference | what | vLLM's op |
|---|---|---|
| ``rms_norm`` / ``rms_norm_ref`` | RMSNorm of ``x`` or of ``residual + x`` (the sum returned) | ``fused_add_rms_norm`` |
| ``rotary_embedding`` / ``rotary_embedding_ref`` | rotate-half RoPE of each token's heads | ``rotary_embedding`` |
| ``silu_and_mul`` / ``silu_and_mul_ref`` | ``silu(gate) * up`` of a fused ``[gate | up]`` product | ``silu_and_mul`` |

Eager, each of these is 3-8 PyTorch kernels with a round trip through memory between them (the norm's upcast, square,
mean, rsqrt and two multiplies; the rotary's slices, negation, concatenation, two multiplies and an add); one launch
each here, which is what ``torch.compile`` makes of them in the compiled layers. They are the kernels of the fused
eager decoder layers (``paged_transformers.compilation.fused_layers``). Every wrapper computes in fp32 and rounds to
the model dtype where transformers' eager code does.
"""

import torch

from .._launch import cdiv, load_triton_kernels, next_power_of_2

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SILU_BLOCK = 1024  # columns per SiLU-and-mul program
ROTARY_BLOCK_H = 8  # heads per rotary program


def _check_rows(name: str, t: torch.Tensor, width: int | None = None) -> None:
    """Raise ``ValueError`` unless ``t`` is 2-D (``width`` columns when given), of a float dtype, unit-strided along
    its columns."""
    if t.dim() != 2 or (width is not None and t.shape[1] != width):
        want = "[num_tokens, D]" if width is None else f"[num_tokens, {width}]"
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dim, got strides {t.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) as transformers' ``LlamaRMSNorm``: ``weight * (s * rsqrt(mean(s^2) + eps))``,
    ``s = x`` upcast to fp32 and the normed row rounded to x's dtype before the weight multiplies it. With
    ``residual``, ``s = residual + x`` (rounded to x's dtype first, as the eager add is), returned as well: the
    decoder layer's residual stream (vLLM's ``fused_add_rms_norm``, out of place).

    Args:
        x: ``[num_tokens, D]`` float32 / float16 / bfloat16, unit stride along D (any row stride).
        weight: ``[D]``, any of those dtypes; the output has ``torch.promote_types(weight, x)``'s dtype, as the eager
            ``weight * hidden.to(x.dtype)``.
        eps: added to the mean square (``variance_epsilon``).
        residual: optional ``[num_tokens, D]`` in x's dtype, unit stride along D.

    Returns:
        ``out [num_tokens, D]`` contiguous, or ``(out, residual + x)`` with a residual.

    Raises:
        ValueError: a shape, dtype or stride other than the above; a device that differs from x's.
        RuntimeError: a CPU tensor without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    _check_rows("x", x)
    T, D = x.shape
    if weight.shape != (D,) or weight.dtype not in _DTYPES or weight.device != x.device:
        raise ValueError(f"weight must be [{D}] float on {x.device}, got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    if residual is not None:
        _check_rows("residual", residual, D)
        if residual.dtype != x.dtype or residual.shape[0] != T or residual.device != x.device:
            raise ValueError(f"residual must be [{T}, {D}] {x.dtype} on {x.device}, got {tuple(residual.shape)} "
                             f"{residual.dtype} on {residual.device}")
    out = torch.empty((T, D), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty((T, D), dtype=x.dtype, device=x.device) if residual is not None else out
    if T:
        r = residual if residual is not None else x
        kernels = load_triton_kernels("layer_ops.triton_kernels", x.device)
        kernels._rms_norm_kernel[(T,)](x, r, weight.contiguous(), out, total, x.stride(0), r.stride(0), out.stride(0),
                                       total.stride(0), D, float(eps), HAS_RESIDUAL=residual is not None,
                                       BLOCK_D=next_power_of_2(D), num_warps=8 if D >= 2048 else 4)
    return (out, total) if residual is not None else out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` in PyTorch: transformers' ``LlamaRMSNorm.forward`` (after ``residual + x``)."""
    s = x if residual is None else residual + x
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, s)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (RoFormer, Su et al. 2021) in the rotate-half layout (GPT-NeoX, Llama):
    ``x * cos + rotate_half(x) * sin`` per head, each product and the sum rounded to x's dtype as transformers'
    ``apply_rotary_pos_emb``. ``cos``/``sin`` are the model's rotary embedding output for each token's position
    (any rope scaling is already in them).

    Args:
        x: ``[num_tokens, num_heads, head_dim]`` float, unit stride along head_dim (any token and head strides: the
            heads of a column slice of a fused q|k|v product), ``head_dim`` a power of two >= 2.
        cos, sin: ``[num_tokens, head_dim]``, unit stride along head_dim, on x's device.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` contiguous, x's dtype.

    Raises:
        ValueError: a shape, dtype or stride other than the above.
        RuntimeError: a CPU tensor without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [num_tokens, num_heads, head_dim], got shape {tuple(x.shape)}")
    T, H, D = x.shape
    if D < 2 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two >= 2, got {D}")
    if x.dtype not in _DTYPES or x.stride(2) != 1:
        raise ValueError(f"x must be float32, float16 or bfloat16 with unit stride along head_dim, got {x.dtype}, "
                         f"strides {x.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        _check_rows(name, t, D)
        if t.shape[0] != T or t.device != x.device:
            raise ValueError(f"{name} must be [{T}, {D}] on {x.device}, got {tuple(t.shape)} on {t.device}")
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T and H:
        block_h = min(next_power_of_2(H), ROTARY_BLOCK_H)
        kernels = load_triton_kernels("layer_ops.triton_kernels", x.device)
        kernels._rotary_kernel[(T, cdiv(H, block_h))](x, cos, sin, out, H, x.stride(0), x.stride(1), cos.stride(0),
                                                      sin.stride(0), out.stride(0), out.stride(1), HALF=D // 2,
                                                      BLOCK_H=block_h, num_warps=4)
    return out


def rotary_embedding_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rotary_embedding`` in PyTorch: transformers' ``apply_rotary_pos_emb`` on ``[T, H, D]`` heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :]) + (rotated * sin[:, None, :])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation (SwiGLU, Shazeer 2020): ``silu(gate) * up`` of ``x = [gate | up]``, the SiLU
    rounded to x's dtype before the product as the eager ``act_fn(gate_proj(x)) * up_proj(x)``.

    Args:
        x: ``[num_tokens, 2 * I]`` float, unit stride along the columns (the fused gate|up product).

    Returns:
        ``[num_tokens, I]`` contiguous, x's dtype.

    Raises:
        ValueError: not 2-D with an even, positive width; another dtype or stride.
        RuntimeError: a CPU tensor without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    _check_rows("x", x)
    T, width = x.shape
    if width == 0 or width % 2:
        raise ValueError(f"x must be [num_tokens, 2 * I] with I >= 1, got width {width}")
    I = width // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if T:
        kernels = load_triton_kernels("layer_ops.triton_kernels", x.device)
        kernels._silu_and_mul_kernel[(T, cdiv(I, SILU_BLOCK))](x, out, x.stride(0), out.stride(0), I,
                                                               BLOCK=SILU_BLOCK, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul`` in PyTorch."""
    I = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :I]) * x[..., I:]


__all__ = ["rms_norm", "rms_norm_ref", "rotary_embedding", "rotary_embedding_ref", "silu_and_mul", "silu_and_mul_ref"]
