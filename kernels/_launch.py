"""Helpers shared by the kernel families of this package.

Each family is a folder of one shape::

    <family>/__init__.py        the launch wrapper (validates its arguments, derives the grid) and the PyTorch reference
    <family>/triton_kernels.py  its @triton.jit kernels, imported by the wrapper on its first launch (load_triton_kernels)

(``cache_ops``, ``paged_attention``, ``argmax``, ``gemv``; ``w4a16/`` has the same parts in more modules: ``matmul``
the wrapper, ``reference``, the ``*_kernels`` modules.)

NOTE: the Triton kernel modules are imported on the first launch, not with this package. Triton decides between
compiling and interpreting when a kernel is *defined* (from ``TRITON_INTERPRET``), so an early import, e.g. by
another kernel module of this package, must not fix that choice; and the PyTorch references must work without
triton installed.
"""

import functools
import importlib

import torch


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first tensor that is not on ``device``."""
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (the cache's device)")


def load_triton_kernels(module: str, device: torch.device):
    """Import the kernel module ``module`` of this package, checking that it can run on ``device``.

    Raises:
        RuntimeError: triton is not installed, or ``device`` is not CUDA and the kernels were not
            defined under the interpreter (``TRITON_INTERPRET=1`` set before their first use).
    """
    try:
        mod = importlib.import_module(f".{module}", __package__)
    except ImportError as e:
        raise RuntimeError(f"the Triton kernels need the triton package: {e}") from e
    if device.type != "cuda":
        from triton.runtime.interpreter import InterpretedFunction

        if not all(isinstance(k, InterpretedFunction) for k in _kernels_of(mod)):
            raise RuntimeError(
                f"Triton kernels need CUDA tensors, got {device}; to run them on the CPU set TRITON_INTERPRET=1 "
                "before the first Triton launch of paged_transformers.kernels in this process (or use the PyTorch "
                "reference, attention_backend='torch')"
            )
    return mod


def _kernels_of(mod) -> list:
    """The ``@triton.jit`` objects of a kernel module (compiled or interpreted)."""
    from triton.runtime.jit import KernelInterface

    return [v for v in vars(mod).values() if isinstance(v, KernelInterface)]


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device, stand_in: int) -> int:
    """Streaming multiprocessors of a CUDA device, or ``stand_in`` for any other device (the Triton interpreter on
    CPU has none): each launch heuristic says what its CPU runs should behave like."""
    if device.type != "cuda":
        return stand_in
    return torch.cuda.get_device_properties(device).multi_processor_count
