"""Megatron's tensor-parallel split of an unmodified transformers decoder, in place, for one rank.

Per decoder layer (Megatron-LM, Shoeybi et al. 2019; vLLM's ``ColumnParallelLinear`` / ``RowParallelLinear``)::

    q_proj, k_proj, v_proj   column split by heads: rank r keeps query heads r*H/tp .. (r+1)*H/tp - 1 and their
                             KV heads (fewer KV heads than ranks: each KV head is replicated on tp/Hkv ranks)
    o_proj                   row split on the same heads, then one all-reduce of its output
    gate_proj, up_proj       column split of the intermediate features
    down_proj                row split on those features, then one all-reduce of its output

The model's own forward code runs unchanged: its attention reshapes with ``view(*input_shape, -1, head_dim)``
(transformers' own tensor parallelism relies on the same), so a shard's projections give it its local head
count; the attention modules' ``num_key_value_groups`` (read by eager/SDPA attention) is set to the local ratio.
The all-reduce is a forward hook on the module (``torch.distributed._functional_collectives``, which
``torch.compile`` traces and NCCL records in CUDA graphs). The embedding is replicated; the LM head is split by
vocabulary rows (zero rows pad it to a multiple of ``tp``) and its logits all-gathered (``parallel_lm_head``):
on CPU with 2 gloo ranks of one thread (SmolLM2-135M's head, 576 x 49152, fp32; ``research/tp_lm_head.py``) the
split head with its gather takes about a quarter less time per step than the replicated one at batch 1 to 256,
and each rank holds half of it. All ranks get the whole logits (an all-gather, not a gather to rank
0: a CUDA graph records it like the all-reduces, and the runner's output is the same on every rank).

Why not transformers' ``tp_plan="auto"``: it shards at ``from_pretrained`` only (not our GPTQ/AWQ loader, not a
loaded model), it cannot replicate KV heads when there are fewer than ranks, and it leaves quantized layers
alone. Its plan is still read: a model whose ``base_model_tp_plan`` is not this column/row split of these
modules (Phi-3's fused ``qkv_proj``) is refused.

Quantized layers (``QuantLinear``, ``[.., out_features]`` layout) split the same way. A row split slices the
packed rows and the groups, which needs ``K/tp`` to be a multiple of the group size. GPTQ act-order
(``desc_act``) stores the rows permuted (``perm``): rank r's contiguous slice of the stored rows is the input
features ``perm[r*K/tp:(r+1)*K/tp]``; for ``down_proj`` those are exactly the intermediate features gate/up keep
on rank r (any set works there), so the split is exact and the shard needs no permutation. The trap
vllm-project/vllm#7374 hit is slicing such a layer by its input features with the groups of the stored order.
Where a row split cannot be sliced (``o_proj`` of act-order checkpoints, whose input features are fixed by the heads;
groups straddling the shard boundary), the layer stays whole and gathers its input instead of reducing its output.
"""

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from ..core.sizing import model_kv_shape
from ..quantization.linear import QuantLinear

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """The head split of a model over ``tp`` ranks.

    Attributes:
        tp: ranks. num_heads, num_kv_heads, head_dim: the model's (all ranks together).
    """

    tp: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def local_num_heads(self) -> int:
        return self.num_heads // self.tp

    @property
    def local_num_kv_heads(self) -> int:
        """KV heads per rank (1 when there are fewer KV heads than ranks: replicated)."""
        return max(self.num_kv_heads // self.tp, 1)

    def q_features(self, rank: int) -> torch.Tensor:
        """Rank's output features of q_proj (= input features of o_proj), int64 ``[local_num_heads * head_dim]``."""
        start = rank * self.local_num_heads * self.head_dim
        return torch.arange(start, start + self.local_num_heads * self.head_dim)

    def kv_features(self, rank: int) -> torch.Tensor:
        """Rank's output features of k_proj / v_proj, int64 ``[local_num_kv_heads * head_dim]``."""
        first_head = rank * self.num_kv_heads // self.tp
        start = first_head * self.head_dim
        return torch.arange(start, start + self.local_num_kv_heads * self.head_dim)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules with a ``self_attn`` and an ``mlp`` (transformers' decoder layers)."""
    return [m for m in model.modules() if isinstance(getattr(m, "self_attn", None), nn.Module)
            and isinstance(getattr(m, "mlp", None), nn.Module)]  # fmt: skip


def check_shardable(model: nn.Module, tp: int) -> ShardPlan:
    """The split of ``model`` over ``tp`` ranks, checked before anything is changed (a meta-device skeleton will do).

    Raises:
        ValueError: ``tp`` not dividing the attention heads or the intermediate size; KV heads that are neither a
            multiple nor a divisor of ``tp``; an architecture this split does not fit (no decoder layers with
            ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj`` linears, or a ``base_model_tp_plan`` that
            splits them otherwise), named with its class.
    """
    name = type(model).__name__
    text_config = model.config.get_text_config()
    _check_tp_plan(name, getattr(text_config, "base_model_tp_plan", None))
    layers = decoder_layers(model)
    for layer in layers or [None]:
        missing = [f"{part}.{proj}" for part, projs in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                                          ("mlp", ("gate_proj", "up_proj", "down_proj")))
                   for proj in projs if not isinstance(getattr(getattr(layer, part, None), proj, None), (nn.Linear, QuantLinear))]
        if missing:
            raise ValueError(f"{name} cannot be split for tensor parallelism: its decoder layers have no {missing} "
                             "linear layers (the column/row split this engine applies); use tensor_parallel_size=1")
    _, num_kv_heads, head_dim = model_kv_shape(model.config)
    plan = ShardPlan(tp, text_config.num_attention_heads, num_kv_heads, head_dim)
    if plan.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide {name}'s num_attention_heads={plan.num_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must divide {name}'s num_key_value_heads={num_kv_heads} or be a "
                         "multiple of it (then each KV head is replicated)")
    intermediate = layers[0].mlp.gate_proj.out_features
    if intermediate % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide {name}'s intermediate size {intermediate}")
    return plan


def _check_tp_plan(name: str, tp_plan: dict | None) -> None:
    if not tp_plan:
        return  # no plan of its own: the module names decide
    for proj in COLUMN + ROW:
        styles = {style for key, style in tp_plan.items() if key.endswith("." + proj)}
        want = "colwise" if proj in COLUMN else "rowwise"
        if styles != {want}:
            raise ValueError(f"{name} cannot be split for tensor parallelism: its base_model_tp_plan {tp_plan} does "
                             f"not split {proj} {want} (the column/row split this engine applies)")


def shard_model(model: nn.Module, rank: int, tp: int, group, parallel_lm_head: bool = True) -> ShardPlan:
    """Keep rank ``rank``'s share of every decoder layer (module docstring), in place, and hook the collectives.

    Args:
        model: a transformers causal LM (``check_shardable``); its weights on any device.
        rank, tp: this rank and the number of ranks. group: the process group of the ``tp`` ranks.
        parallel_lm_head: split the LM head by vocabulary and all-gather its logits; False keeps it whole on
            every rank.

    Returns:
        The ``ShardPlan``.

    Raises:
        ValueError: as ``check_shardable``.
    """
    plan = check_shardable(model, tp)
    for layer in decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        _take_out(attn.q_proj, plan.q_features(rank))
        _take_out(attn.k_proj, plan.kv_features(rank))
        _take_out(attn.v_proj, plan.kv_features(rank))
        _split_rows(attn.o_proj, plan.q_features(rank), rank, tp, group)
        for attr, value in (("num_heads", plan.local_num_heads), ("num_key_value_heads", plan.local_num_kv_heads),
                            ("num_key_value_groups", plan.local_num_heads // plan.local_num_kv_heads)):
            if hasattr(attn, attr):
                setattr(attn, attr, value)
        intermediate = mlp.gate_proj.out_features // tp
        features = _split_rows(mlp.down_proj, torch.arange(rank * intermediate, (rank + 1) * intermediate), rank, tp,
                               group, free=True)
        _take_out(mlp.gate_proj, features)
        _take_out(mlp.up_proj, features)
    lm_head = model.get_output_embeddings()
    if parallel_lm_head and isinstance(lm_head, (nn.Linear, QuantLinear)):
        _split_vocab(lm_head, rank, tp, group)
    return plan


def _split_rows(linear: nn.Module, features: torch.Tensor, rank: int, tp: int, group, free: bool = False) -> torch.Tensor:
    """Row-split ``linear`` to the rank's input ``features`` and all-reduce its output; a ``QuantLinear`` whose
    stored rows cannot be sliced to them stays whole and all-gathers its input instead. ``free``: any feature set
    of that size will do (the caller splits the producing layers to the returned one).

    Returns:
        The input features the layer takes on this rank, int64, in the order it takes them.
    """
    if isinstance(linear, QuantLinear):
        start, stop = rank * linear.in_features // tp, (rank + 1) * linear.in_features // tp
        stored = linear.perm[start:stop] if linear.perm is not None else torch.arange(start, stop)
        if not _quant_rows_sliceable(linear, start, stop) or not (free or torch.equal(stored.cpu(), features)):
            linear.register_forward_pre_hook(_gather_input_hook(group, tp))
            return features
        _slice_quant_rows(linear, start, stop, keep_bias=rank == 0)
        linear.register_forward_hook(_all_reduce_hook(group))
        return stored.cpu()
    linear.weight = nn.Parameter(linear.weight[:, features.to(linear.weight.device)].contiguous(), requires_grad=False)
    linear.in_features = len(features)
    if linear.bias is not None and rank != 0:
        linear.bias = None  # added once, by rank 0, before the sum
    linear.register_forward_hook(_all_reduce_hook(group))
    return features


def _take_out(linear: nn.Module, features: torch.Tensor) -> None:
    """Column split: keep the output ``features`` (int64 indices) of an ``nn.Linear`` or ``QuantLinear``."""
    if isinstance(linear, QuantLinear):
        idx = features.to(linear.qweight.device)
        for name in ("qweight", "scales", "zeros"):
            setattr(linear, name, getattr(linear, name)[:, idx].contiguous())
        linear._cpu_cache = None
    else:
        idx = features.to(linear.weight.device)
        linear.weight = nn.Parameter(linear.weight[idx].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[idx].contiguous(), requires_grad=False)
    linear.out_features = len(features)


def _quant_rows_sliceable(linear: QuantLinear, start: int, stop: int) -> bool:
    pack = 32 // linear.bits
    whole_group = linear.group_size == linear.in_features  # per channel: one group, kept by every rank
    return start % pack == 0 and stop % pack == 0 and (whole_group or (start % linear.group_size == 0
                                                                         and stop % linear.group_size == 0))


def _slice_quant_rows(linear: QuantLinear, start: int, stop: int, keep_bias: bool) -> None:
    """Keep the stored rows ``start:stop`` of a ``QuantLinear`` (input features in stored order) and their groups;
    the shard takes its input in that order, so it holds no permutation."""
    pack = 32 // linear.bits
    linear.qweight = linear.qweight[start // pack: stop // pack].contiguous()
    if linear.group_size != linear.in_features:
        g0, g1 = start // linear.group_size, stop // linear.group_size
        linear.scales, linear.zeros = linear.scales[g0:g1].contiguous(), linear.zeros[g0:g1].contiguous()
    else:
        linear.group_size = stop - start
    linear.perm = None
    linear.in_features = stop - start
    linear._cpu_cache = None
    if not keep_bias:
        linear.bias = None


def _split_vocab(lm_head: nn.Module, rank: int, tp: int, group) -> None:
    """Keep the rank's rows of the LM head (zero rows pad a vocabulary that ``tp`` does not divide) and all-gather
    the logits; the input embedding, tied or not, keeps the whole table."""
    vocab = lm_head.out_features
    per_rank = -(-vocab // tp)
    rows = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    if isinstance(lm_head, QuantLinear) and vocab % tp:
        return  # no zero rows for packed weights: stays whole
    if vocab % tp:
        pad = torch.zeros(per_rank * tp - vocab, lm_head.in_features, dtype=lm_head.weight.dtype, device=lm_head.weight.device)
        lm_head.weight = nn.Parameter(torch.cat([lm_head.weight.detach(), pad]), requires_grad=False)
        if lm_head.bias is not None:
            lm_head.bias = nn.Parameter(torch.cat([lm_head.bias.detach(), pad[:, 0]]), requires_grad=False)
    _take_out(lm_head, rows)
    lm_head.register_forward_hook(_gather_vocab_hook(group, tp, vocab))


def _all_reduce_hook(group):
    def all_reduce(module, args, output):
        return funcol.all_reduce(output, "sum", group)

    return all_reduce


def _all_gather_last(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """``[..., n]`` per rank -> ``[..., tp * n]``, rank 0's columns first."""
    gathered = funcol.all_gather_single(x.contiguous(), 0, group)  # [tp * x.shape[0], ...]
    return gathered.view(tp, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], tp * x.shape[-1])


def _gather_input_hook(group, tp: int):
    def gather_input(module, args):
        return (_all_gather_last(args[0], group, tp),) + tuple(args[1:])

    return gather_input


def _gather_vocab_hook(group, tp: int, vocab: int):
    def gather_vocab(module, args, output):
        return _all_gather_last(output, group, tp)[..., :vocab]

    return gather_vocab
