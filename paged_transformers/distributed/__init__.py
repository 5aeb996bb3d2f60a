"""Tensor parallelism over ``torch.distributed`` for unmodified transformers models.

- ``sharding``: Megatron's column / row split of the decoder layers, in place, with the collectives as hooks.
- ``protocol``: what rank 0 (the one scheduler) sends the other ranks each step, and the channel.
- ``engine``: ``ShardedEngine`` (every rank), ``DriverEngine`` (rank 0), ``serve`` (the workers' loop).
- ``launcher``: ``start_engine``, one process per rank or the ranks of an existing (torchrun) group.

``LLM(path, tensor_parallel_size=N)`` is the entry point.
"""

from .engine import DriverEngine, ShardedEngine, serve
from .launcher import max_tensor_parallel_size, start_engine
from .sharding import ShardPlan, check_shardable, shard_model

__all__ = ["DriverEngine", "ShardPlan", "ShardedEngine", "check_shardable", "max_tensor_parallel_size", "serve",
           "shard_model", "start_engine"]
