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

import contextlib
import contextvars
import functools
import importlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger("paged_transformers")

# True inside ``compile_only()`` (a context variable: the thread and context that entered it, nothing else)
_COMPILE_ONLY = contextvars.ContextVar("paged_transformers_compile_only", default=False)
COMPILE_THREADS = 8  # most threads ``compile_only`` compiles in (ptxas and the MLIR passes use one core each)


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

    Inside ``compile_only()``, on CUDA, the module comes wrapped so that its kernels' launches compile and do not
    run (``_CompileOnlyKernels``).

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
    elif _COMPILE_ONLY.get():
        return _CompileOnlyKernels(mod)
    return mod


@contextlib.contextmanager
def compile_only():
    """Inside, a launch of this package's Triton kernels on CUDA compiles the kernel variant it needs (its
    specialization: constexprs, dtypes, alignment and the int arguments' classes) in a pool of threads and returns
    without running: its outputs are left unwritten. Leaving waits for every compile; later launches of those
    variants find them compiled.

    For dummy forwards whose results are thrown away: the engine's warm-ups (``ModelRunner._compile`` /
    ``_precompile_kernels``), where Dynamo and Inductor keep the main thread busy for seconds and each of our kernels'
    JIT compiles took 0.3-1.5 s after them. Triton's compile releases the GIL for its MLIR passes and ptxas, so the
    variants compile beside the tracing, several at a time (Triton's ``AsyncCompileMode``, in Triton >= 3.5). On the
    CPU (the interpreter compiles nothing), with an older Triton, or inside a Triton async mode of the caller's own,
    launches run as outside.

    A variant whose compile fails is logged here; its launches raise that error later, as without this.

    Raises:
        RuntimeError: nested in another ``compile_only`` (with Triton's async mode; its mode allows one at a time).
    """
    try:
        from triton.runtime._async_compile import AsyncCompileMode, active_mode
    except ImportError:  # no triton (the CPU reference paths) or one without the async mode: nothing to defer
        yield
        return
    if _COMPILE_ONLY.get():
        raise RuntimeError("compile_only() is already active in this context")
    if active_mode.get() is not None:  # the caller's own async compiles: leave them alone
        yield
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    pool = ThreadPoolExecutor(min(COMPILE_THREADS, cores), thread_name_prefix="triton-compile")
    mode = AsyncCompileMode(pool)
    mode.__enter__()
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)
        try:
            mode.__exit__(None, None, None)  # waits for the compiles, installs them in the kernels' caches
        except Exception as e:  # the failed variant stays pending in its kernel's cache and raises at its launch
            logger.warning("paged_transformers: a Triton kernel variant failed to compile ahead: %s: %s",
                           type(e).__name__, e)
        finally:
            active_mode.set(None)  # Triton 3.5/3.6 leave it set when a compile failed
            pool.shutdown(wait=True)


class _CompileOnlyKernels:
    """A kernel module seen through ``compile_only``: ``mod.kernel[grid](*args, **kwargs)`` becomes
    ``mod.kernel.warmup(*args, grid=grid, **kwargs)`` (compile, no launch); other attributes pass through."""

    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name: str):
        value = getattr(self._mod, name)
        warmup = getattr(value, "warmup", None)
        if warmup is None:
            return value
        return _GridIndexable(warmup)


class _GridIndexable:
    """``[grid]`` -> ``warmup`` with that grid, as a JIT function's ``[grid]`` gives its launcher."""

    def __init__(self, warmup):
        self._warmup = warmup

    def __getitem__(self, grid):
        return functools.partial(self._warmup, grid=grid)


def _kernels_of(mod) -> list:
    """The ``@triton.jit`` objects of a kernel module (compiled or interpreted)."""
    from triton.runtime.jit import KernelInterface

    return [v for v in vars(mod).values() if isinstance(v, KernelInterface)]


@functools.lru_cache(maxsize=None)
def cuda_capability(device: torch.device, stand_in: tuple[int, int]) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a CUDA device, or ``stand_in`` for any other device (as ``num_sms``)."""
    if device.type != "cuda":
        return stand_in
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device, stand_in: int) -> int:
    """Streaming multiprocessors of a CUDA device, or ``stand_in`` for any other device (the Triton interpreter on
    CPU has none): each launch heuristic says what its CPU runs should behave like."""
    if device.type != "cuda":
        return stand_in
    return torch.cuda.get_device_properties(device).multi_processor_count
