"""The engines of a tensor-parallel model: ``ShardedEngine`` on every rank, ``DriverEngine`` on rank 0, and the
workers' loop (``serve``). The protocol between them is ``protocol.py``'s."""

import contextlib
import logging
from collections.abc import Iterator

import torch

from ..core.engine import LLMEngine
from ..core.sizing import model_kv_shape
from .protocol import CALLS, Call, Channel, Query, Shutdown, Step, batch_tables
from .sharding import ShardPlan

logger = logging.getLogger(__name__)


class ShardedEngine(LLMEngine):
    """An ``LLMEngine`` over one rank's model shard (``sharding.shard_model``): its KV pool holds the rank's KV
    heads, in as many blocks as the smallest rank's pool (the block ids are rank 0's, for every rank).

    Constructed on every rank at the same time (the pool sizing and compiled layers' warm-up forwards are
    collective). A worker uses only its runner and lifecycle methods, through ``serve``.

    Args:
        model: the rank's shard. tokenizer, engine_config: as ``LLMEngine`` (``tensor_parallel_size`` the ranks).
        shard_plan: the model's ``ShardPlan``. channel: the ranks' ``protocol.Channel``.

    Raises:
        ValueError: as ``LLMEngine``.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, engine_config, shard_plan: ShardPlan, channel: Channel):
        self.shard_plan, self.channel = shard_plan, channel
        super().__init__(model, tokenizer=tokenizer, engine_config=engine_config)

    def _kv_shape(self) -> tuple[int, int, int]:
        num_layers, _, head_dim = model_kv_shape(self.model.config)
        return num_layers, self.shard_plan.local_num_kv_heads, head_dim

    def _agree_num_blocks(self, num_blocks: int) -> int:
        return self.channel.min(num_blocks)


class DriverEngine(ShardedEngine):
    """Rank 0's engine: the one scheduler of all ranks. Each step's plan goes to the workers before its forward
    (``protocol.Step``); each lifecycle method runs here, then on the workers (``protocol.Call``).

    ``shutdown`` (set by the launcher) ends the workers after ``close``; ``worker_processes`` are the ones it started
    (none under an existing group); ``worker_tables()`` reads the workers' batches.
    """

    def __init__(self, *args, **kwargs):
        self._mirror = False  # no messages while constructing: a failed construction fails on every rank
        self.shutdown = None
        self.worker_processes = []
        super().__init__(*args, **kwargs)
        self._mirror = True

    def _launch(self, plan, input_ids=None):
        self.channel.send(Step(plan, None if input_ids is None else int(input_ids.shape[0])))
        if input_ids is not None:
            self.channel.send_ids(input_ids)
        return super()._launch(plan, input_ids)

    def _call(self, name: str) -> None:
        if self._mirror:
            self.channel.send(Call(name))

    def attach(self) -> None:
        super().attach()
        self._call("attach")

    def detach(self) -> None:
        super().detach()
        self._call("detach")

    def sleep(self, level: int = 1) -> None:
        super().sleep(level)
        self._call("sleep")

    def wake_up(self) -> None:
        super().wake_up()
        self._call("wake_up")

    def capture_cudagraphs(self) -> int:
        self._call("capture_cudagraphs")  # before: every rank's captures run their collectives together
        return super().capture_cudagraphs()

    def reset_prefix_cache(self) -> bool:
        emptied = super().reset_prefix_cache()
        self._call("reset_prefix_cache")
        return emptied

    def close(self) -> None:
        """Close here and on every worker, then end the workers (``shutdown``). Idempotent. A worker that died (its
        process killed, or lost) cannot take the message, and the collective raises: the close goes on without it,
        logging that once (``_lost_workers``), as the launcher's shutdown ends the workers whatever state they are in.
        """
        was_closed = self.closed
        try:
            super().close()
            if not was_closed:
                try:
                    self._call("close")
                except RuntimeError as e:  # gloo's / NCCL's error for a rank that is gone
                    logger.warning("%s; closed without it", self._lost_workers(e))
        finally:
            shutdown, self.shutdown = self.shutdown, None
            if shutdown is not None:
                shutdown()

    def _lost_workers(self, error: RuntimeError) -> str:
        """What a failed message to the workers says: the spawned workers that exited (name, pid, exit code), or,
        when none did (a group made by torchrun: its processes are not ours), the collective's error."""
        for p in self.worker_processes:
            p.join(0.5)  # a killed worker's exit code, once it is reaped
        dead = [f"{p.name} (pid {p.pid}) exited with code {p.exitcode}" for p in self.worker_processes
                if p.exitcode is not None]  # fmt: skip
        return "tensor-parallel worker " + ", ".join(dead) if dead else f"tensor-parallel workers unreachable ({error})"

    def worker_tables(self) -> list[dict[int, list[int]]]:
        """Every rank's persistent block tables (``protocol.batch_tables``), rank 0's first."""
        self.channel.send(Query())
        return self.channel.gather(batch_tables(self.runner))

    @contextlib.contextmanager
    def for_call(self) -> Iterator["DriverEngine"]:
        """The engine woken and attached for one call; on exit, even on error, unfinished requests are aborted
        (no block stays held) and it is detached (``warm.attached_engine``'s contract, for an engine of its own)."""
        self.wake_up()
        self.attach()
        try:
            yield self
        finally:
            for request_id in list(self.requests):
                self.abort_request(request_id)
            self.detach()


def serve(engine: ShardedEngine) -> None:
    """A worker's loop: run rank 0's messages (``protocol.py``) on ``engine`` until ``Shutdown``."""
    channel = engine.channel
    while True:
        message = channel.recv()
        if isinstance(message, Step):
            ids = None if message.num_input_ids is None else channel.recv_ids(message.num_input_ids, engine.device)
            engine.runner.execute(message.plan, ids)
        elif isinstance(message, Call):
            assert message.name in CALLS, message
            getattr(engine, message.name)()
        elif isinstance(message, Query):
            channel.gather(batch_tables(engine.runner))
        else:
            assert isinstance(message, Shutdown), message
            channel.gather(None)  # every rank past its last message before any destroys the groups
            return
