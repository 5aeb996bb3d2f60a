"""Start the ranks of a tensor-parallel engine: one process per rank, or the processes of an existing group.

``start_engine`` checks everything it can before a process starts (the checkpoint, the dtype, and the split on a
meta-device skeleton of the model: ``sharding.check_shardable``). Then:

- **No process group yet** (``LLM(path, tensor_parallel_size=N)`` in a plain script): the calling process is rank 0;
  it spawns ranks 1 .. N-1 (``multiprocessing`` ``spawn``, daemonic) and joins them in a fresh default group over
  TCP on 127.0.0.1 (NCCL on CUDA, device ``cuda:<rank>``; gloo on CPU, each worker with ``cpu_count // N`` threads).
- **Under ``torchrun``** (``torch.distributed`` already initialized, ``world_size == N``): every process runs the same
  script; rank 0's ``start_engine`` returns the driver, the other ranks serve it inside ``start_engine`` and return
  None once it closes (``LLM`` then destroys the default group and exits the process: a gloo group left alive at
  interpreter exit can abort it). Across hosts this is torchrun's rendezvous (not tested)::

      torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 serve.py
      # serve.py: torch.distributed.init_process_group("nccl"); llm = LLM(path, tensor_parallel_size=8); ...

  Each process takes ``cuda:$LOCAL_RANK``; the all-reduces then cross the hosts' network, which only pays off
  for large models (vLLM runs TP inside a host and pipeline parallelism across hosts).

Every rank loads the whole checkpoint on the CPU, keeps its shard and moves it to its device. Startup has two
agreed phases (load + shard, build the engine): a failure on any rank is gathered and raised on rank 0, and every
rank leaves. On CUDA, NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` in every rank's environment).

Shutdown (``DriverEngine.close``, also from ``LLM.close``, at interpreter exit and when the driver raises):
``Shutdown`` to the workers, a join, then terminate / kill for any that did not leave; the groups made here are
destroyed.
"""

import atexit
import dataclasses
import functools
import os
import socket
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import EngineConfig
from ..integration import checkpoint
from ..hub import resolve_model_path
from ..quantization.loader import build_skeleton
from .engine import DriverEngine, ShardedEngine, serve
from .protocol import Channel, Shutdown
from .sharding import check_shardable, shard_model

JOIN_TIMEOUT_S = 30.0
START_TIMEOUT_S = 300.0  # a spawned rank must reach run_rank (Python, torch and this package imported) by then
# the open engine whose ranks this process spawned: it owns the default process group, so it is the only one
_spawned: "weakref.ref[DriverEngine] | None" = None


@dataclasses.dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank needs to load its shard and build its engine (pickled to spawned workers)."""

    folder: str
    dtype: torch.dtype
    device_type: str  # "cuda" or "cpu"
    trust_remote_code: bool
    engine_config: EngineConfig
    init_method: str | None  # tcp://127.0.0.1:PORT of a group made here; None: the process group exists
    num_threads: int


def max_tensor_parallel_size(device_type: str) -> int:
    """The most ranks one host runs: one per CUDA device; on CPU two per core (``2 * os.cpu_count()``: a gloo rank
    spends much of a step waiting in collectives, so two share a core; more only slows every rank down)."""
    return torch.cuda.device_count() if device_type == "cuda" else 2 * (os.cpu_count() or 1)


def start_engine(model, *, tokenizer, skip_tokenizer_init: bool, trust_remote_code: bool, dtype: torch.dtype | None,
                 quantization: str | None, device: torch.device, engine_config: EngineConfig) -> DriverEngine | None:
    """Rank 0's ``DriverEngine`` over a checkpoint split over ``engine_config.tensor_parallel_size`` ranks (module
    docstring), detached; None on the other ranks of an existing group, after rank 0's engine closed.

    Raises:
        ValueError: a bad checkpoint (``checkpoint.check_checkpoint``), a model the split does not fit or a ``tp``
            that does not divide it (``check_shardable``), ``tp`` over the devices, a group of another size; all
            before a worker starts. A failure on a rank while starting (its message, the rank named), after which
            every started worker has left.
    """
    global _spawned
    tp = engine_config.tensor_parallel_size
    if not dist.is_initialized() and tp > max_tensor_parallel_size(device.type):
        raise ValueError(f"tensor_parallel_size={tp} is over the {max_tensor_parallel_size(device.type)} "
                         f"{'CUDA devices of this host' if device.type == 'cuda' else 'ranks this host runs on CPU (2 per core)'}")
    folder = resolve_model_path(model)
    config_dict = checkpoint.read_config(folder)
    checkpoint.check_checkpoint(folder, config_dict, quantization, engine_config.max_model_len)
    dtype = checkpoint.resolve_dtype(dtype, config_dict, device)
    from transformers import AutoConfig

    skeleton = build_skeleton(AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code), dtype, trust_remote_code)
    check_shardable(skeleton, tp)
    open_engine = _spawned() if _spawned is not None else None
    if open_engine is not None and open_engine.shutdown is not None:
        raise ValueError("another tensor-parallel engine started by this process is open (its ranks hold the default "
                         "process group): close it first (LLM.close())")
    existing = dist.is_initialized()
    if existing and dist.get_world_size() != tp:
        raise ValueError(f"tensor_parallel_size={tp} but the process group has {dist.get_world_size()} ranks")
    threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // tp))
    spec = RankSpec(folder, dtype, device.type, trust_remote_code, engine_config,
                    None if existing else f"tcp://127.0.0.1:{_free_port()}", threads)
    if existing and dist.get_rank() != 0:
        run_rank(spec, dist.get_rank())
        return None
    tokenizer = checkpoint.tokenizer_for(tokenizer, folder, skip_tokenizer_init, trust_remote_code)
    ctx = mp.get_context("spawn")
    started = [ctx.Event() for _ in range(1, tp)] if not existing else []
    procs = [ctx.Process(target=run_rank, args=(spec, r, started[r - 1]), daemon=True, name=f"paged-transformers-tp{r}")
             for r in range(1, tp)] if not existing else []  # fmt: skip
    for p in procs:
        p.start()
    try:
        if not existing:
            _wait_started(procs, started)
            _init_group(spec, 0)
        engine = _build_rank(spec, 0, tokenizer)
    except BaseException:
        _stop(procs, not existing)
        raise
    engine.shutdown = functools.partial(_shutdown, engine.channel, procs, not existing)
    engine.worker_processes = procs
    if not existing:
        _spawned = weakref.ref(engine)
    atexit.register(_close_at_exit, weakref.ref(engine))
    engine.detach()
    return engine


def run_rank(spec: RankSpec, rank: int, started=None) -> None:
    """A worker rank: join the group (when made here), load and shard, build its engine, serve rank 0 until
    ``Shutdown``. The spawned processes' entry point; ``started`` (a ``multiprocessing`` event) is set first."""
    if started is not None:
        started.set()
    if spec.init_method is not None:
        torch.set_num_threads(spec.num_threads)
        _init_group(spec, rank)
    engine = None
    try:
        engine = _build_rank(spec, rank, None)
        if engine is not None:
            serve(engine)
    finally:
        if spec.init_method is not None:
            dist.destroy_process_group()
        elif engine is not None:
            dist.destroy_process_group(engine.channel.control)


def _wait_started(procs: list, started: list) -> None:
    """Wait until every spawned rank has reached ``run_rank``, so that a rank that dies on its way there is an error
    here, not a wait for a group that it never joins.

    Raises:
        RuntimeError: a rank exited first (naming it and its exit code; the usual cause: spawning re-imports the
            caller's main module, which started the engine again at its top level), or ``START_TIMEOUT_S`` passed.
    """
    deadline = time.monotonic() + START_TIMEOUT_S
    for p, event in zip(procs, started):
        while not event.wait(0.1):
            if p.exitcode is not None:
                raise RuntimeError(
                    f"tensor-parallel worker {p.name} exited with code {p.exitcode} before it started. The workers are "
                    "spawned processes, which import the main module of the program again: a script must start "
                    "LLM(..., tensor_parallel_size > 1) under `if __name__ == \"__main__\":`")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel worker {p.name} did not start within {START_TIMEOUT_S:.0f} s")


def _init_group(spec: RankSpec, rank: int) -> None:
    cuda = spec.device_type == "cuda"
    if cuda:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast (NVLS), before the first communicator
    dist.init_process_group("nccl" if cuda else "gloo", init_method=spec.init_method, rank=rank,
                            world_size=spec.engine_config.tensor_parallel_size)


def _device(spec: RankSpec, rank: int) -> torch.device:
    if spec.device_type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) if spec.init_method is None else rank)


def _build_rank(spec: RankSpec, rank: int, tokenizer) -> ShardedEngine | None:
    """Load + shard, then build the rank's engine, each phase agreed by every rank (``_agree``). Returns the engine
    (rank 0: a ``DriverEngine``), or None on a worker when a rank failed."""
    device = _device(spec, rank)
    if device.type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # under torchrun: before the group's first (lazy) NCCL communicator
        torch.cuda.set_device(device)
    tp, group = spec.engine_config.tensor_parallel_size, dist.group.WORLD
    channel = Channel(group)
    model = plan = engine = error = None
    try:
        model = checkpoint.load_checkpoint(spec.folder, spec.dtype, torch.device("cpu"), spec.trust_remote_code)
        plan = shard_model(model, rank, tp, group)
        model.to(device)
    except Exception as e:  # noqa: BLE001 - gathered, raised on rank 0
        error = e
    if not _agree("loading its shard", channel, error):
        return None
    try:
        engine_cls = DriverEngine if rank == 0 else ShardedEngine
        engine = engine_cls(model, tokenizer, spec.engine_config, plan, channel)
    except Exception as e:  # noqa: BLE001
        error = e
    return engine if _agree("building its engine", channel, error) else None


def _agree(phase: str, channel: Channel, error: Exception | None) -> bool:
    """Gather every rank's outcome of ``phase``. True when all succeeded; else rank 0 raises (its own error, or a
    ValueError / RuntimeError naming the failed rank) and the workers return False."""
    outcomes = channel.gather(None if error is None else (isinstance(error, ValueError), f"{type(error).__name__}: {error}"))
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return True
    if channel.rank != 0:
        return False
    if error is not None:
        raise error
    rank, (is_value_error, message) = failed[0]
    raise (ValueError if is_value_error else RuntimeError)(f"tensor-parallel rank {rank} failed {phase}: {message}")


def _shutdown(channel: Channel, procs: list, own_group: bool) -> None:
    """End the workers of a running engine (module docstring)."""
    try:
        channel.send(Shutdown())
        channel.gather(None)  # as the workers do: no message in flight when the groups go
    except Exception:  # noqa: BLE001 - a worker already gone: the processes are ended below
        pass
    _stop(procs, own_group, channel)


def _stop(procs: list, own_group: bool, channel: Channel | None = None) -> None:
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
        for end in (p.terminate, p.kill):
            if p.is_alive():
                end()
                p.join(5.0)
    if dist.is_initialized():
        if own_group:
            dist.destroy_process_group()
        elif channel is not None:
            dist.destroy_process_group(channel.control)


def _close_at_exit(ref: "weakref.ref[DriverEngine]") -> None:
    engine = ref()
    if engine is not None and engine.shutdown is not None:
        engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
