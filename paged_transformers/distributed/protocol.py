"""The messages from rank 0 to the other ranks of a tensor-parallel engine, and the channel that carries them.

Rank 0 (the driver) runs the whole engine: scheduler, block manager, prefix cache, sampling batch (the sampler's
per-sequence state), sampler, logits processors, stops, outputs. Ranks 1 .. tp-1 (the workers) hold a model
shard, a KV pool of the same number of blocks with their share of the KV heads, and a ``ModelRunner``; nothing
else. They do what rank 0 tells them, in the order it tells them, so that the collectives inside the forward
line up::

    rank 0                                          every worker
    ------                                          ------------
    send(Step(plan, num_input_ids))                 Step -> runner.execute(plan, input_ids)
    [broadcast(input_ids [num_input_ids] int64)]    (async scheduling: the decode step's ids on the device)
    runner.execute(plan, input_ids)                 ... the same forward: all-reduces, the logits all-gather
    sample, stops, outputs
    send(Call(name))  after its own engine.name()   engine.name(): attach, detach, sleep, wake_up,
                                                    reset_prefix_cache, close
    send(Query()) + gather                          its persistent batch's block tables, gathered on rank 0
    send(Shutdown()) + gather                       leaves the loop (after the gather: nothing in flight), destroys
                                                    its process groups, exits

The plan (``core.messages.SchedulerOutput``) is frozen data keyed by sequence id: the new block ids of each
sequence, copy-on-write copies, preempted and finished ids. Every rank's runner applies the same diffs to its
persistent batch, so block tables, preemption, prefix-cache hits and aborts cannot diverge: only rank 0 decides
them, and the others only see the results. Workers need no sampled tokens: a plan carries the known token ids,
and a step planned ahead of the last sampling (async scheduling) is followed by its device input ids, broadcast
on the device group (NCCL on CUDA: enqueued on the stream, no host sync).

Messages are pickled (``broadcast_object_list``) on a gloo group of their own (the control group), whose timeout
is long (``IDLE_TIMEOUT``): an idle engine's workers wait there for the next message. A rank that dies closes
its sockets, and the others' pending collective raises.
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.messages import SchedulerOutput

IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class Step:
    """Run ``plan``; ``num_input_ids``: a device tensor of that many input ids follows (None: none follows)."""

    plan: SchedulerOutput
    num_input_ids: int | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """Run the engine's lifecycle method ``name`` (no arguments)."""

    name: str


@dataclass(frozen=True, slots=True)
class Query:
    """Send the persistent batch's block tables to rank 0 (``batch_tables``)."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave the worker loop."""


CALLS = ("attach", "detach", "sleep", "wake_up", "reset_prefix_cache", "close", "capture_cudagraphs")


class Channel:
    """Rank 0's messages to the ranks of ``device_group``.

    Args:
        device_group: the process group of the ranks (NCCL on CUDA, gloo on CPU); its rank 0 sends. Every rank
            of the default group must construct the channel at the same point (it makes the control group).
    """

    def __init__(self, device_group):
        self.device_group = device_group
        ranks = dist.get_process_group_ranks(device_group)
        self.control = dist.new_group(ranks=ranks, backend="gloo", timeout=IDLE_TIMEOUT)
        self.src = ranks[0]  # global rank of the driver
        self.rank = dist.get_rank(device_group)
        self.size = len(ranks)

    def send(self, message) -> None:
        dist.broadcast_object_list([message], src=self.src, group=self.control)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.control)
        return box[0]

    def send_ids(self, input_ids: torch.Tensor) -> None:
        dist.broadcast(input_ids.contiguous(), src=self.src, group=self.device_group)

    def recv_ids(self, n: int, device: torch.device) -> torch.Tensor:
        ids = torch.empty(n, dtype=torch.int64, device=device)
        dist.broadcast(ids, src=self.src, group=self.device_group)
        return ids

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (on every rank)."""
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def min(self, value: int) -> int:
        """The least of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t)


def batch_tables(runner) -> dict[int, list[int]]:
    """A runner's persistent block tables: ``seq_id -> block ids``."""
    batch = runner.batch
    return {seq_id: batch.tables[row, : int(batch.table_lens[row])].tolist() for seq_id, row in batch.row_of.items()}
