"""Engine configuration: the field's standard knobs, validated on construction."""

import enum
from dataclasses import dataclass


class AttentionBackend(enum.Enum):
    """Which implementation runs paged attention. ``AUTO``: Triton on CUDA, torch elsewhere."""

    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"


class UsageContext(enum.Enum):
    """Which entry point builds the engine (vLLM's ``UsageContext``): it picks the default step limits
    (``EngineConfig``'s table). ``LLM_CLASS``: ``LLM``, ``paged_generate``, the patched ``generate()``, ``bench``;
    ``OPENAI_API_SERVER``: ``serve``."""

    LLM_CLASS = "LLM_CLASS"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"


@dataclass(slots=True)
class EngineConfig:
    """Limits and sizes of the paged engine (names as vLLM uses them).

    Args:
        block_size: tokens per KV block (default 16).
        num_gpu_blocks: exact number of KV blocks in the pool; overrides every other sizing knob.
        gpu_memory_utilization: on CUDA, the fraction of the device's memory the whole process may
            use; the KV pool gets what is left of it after weights and a profiled forward.
        kv_cache_memory_bytes: explicit KV pool budget in bytes (all layers, K and V). The default on
            CPU, where there is no device memory to measure, is ``CPU_DEFAULT_KV_BYTES`` (1 GiB),
            capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could use.
        max_model_len: longest sequence (prompt + output) in tokens; default: the model's
            ``max_position_embeddings``. A sequence that reaches it finishes with
            ``finish_reason="length"``; a prompt longer than it is rejected.
        max_num_seqs: most sequences in one step. None (default): by device and ``usage_context``, below.
        max_num_batched_tokens: most tokens (prefill + decode) in one step (the token budget). None (default): by
            device and ``usage_context``, below.
        max_cudagraph_capture_size: the largest decode step (sequences) replayed from a CUDA graph; larger decode
            steps run eagerly. None (default): ``min(2 * max_num_seqs, 512, max_num_batched_tokens)`` (vLLM's).
            Either way capped at ``max_num_batched_tokens`` and, as the graphs hold decode steps only, at
            ``max_num_seqs``. Graphs are captured per bucket at its first step (``capture_cudagraphs()``: all at
            once), so a larger limit costs capture time only when those batch sizes run; the KV pool's sizing
            reserves the memory of every bucket's graph (their static logits) up front.
        usage_context: ``UsageContext`` (or its value as a string) whose defaults the None limits take:
            ``"LLM_CLASS"`` (default) or ``"OPENAI_API_SERVER"`` (what ``serve`` sets).

            The defaults are vLLM's (``EngineArgs.get_batch_defaults``), picked when the engine starts on its
            device (``paged_transformers.core.batch_defaults``); a value given explicitly always wins::

                device                                 LLM_CLASS tokens / seqs   OPENAI_API_SERVER
                CUDA with >= 70 GiB, not an A100            16384 / 1024             8192 / 1024
                other CUDA devices (A100, 40 or 24 GiB)      8192 / 256              2048 / 256
                CPU                                          8192 / 256              8192 / 256

            then ``max_num_batched_tokens = min(max_num_seqs * max_model_len, default)`` (with chunked prefill off,
            at least ``max_model_len`` first) and ``max_num_seqs = min(default, max_num_batched_tokens)``. On CPU the
            engine keeps its earlier values instead of vLLM's (4096 / 256 and 2048 / 128 per rank). ``LLMEngine.config``
            holds the values picked. The KV pool is sized after a profiled step of ``max_num_batched_tokens``
            tokens, so a larger budget leaves a smaller pool within ``gpu_memory_utilization``.
        enable_chunked_prefill: split prompts longer than the remaining token budget across steps.
            When False, a prompt longer than ``max_num_batched_tokens`` is rejected and every prompt
            is computed in one step; a sequence resumed after preemption is still recomputed in chunks.
        enable_prefix_caching: reuse the K/V of full blocks whose tokens (and everything before them)
            match an earlier request's; freed blocks stay reusable until evicted (LRU). On by default.
        attention_backend: ``"auto"``, ``"triton"`` or ``"torch"`` (parsed into ``AttentionBackend``).
        enforce_eager: never use CUDA graphs; by default decode-only steps on CUDA replay a graph captured
            per batch-size bucket at engine start (only with a backend that can be captured: Triton).
            Also turns off ``compile_layers``'s default.
        compile_layers: ``torch.compile`` each decoder layer around the paged attention, fusing the small
            ops between the projections (norms, rotary embedding, activation, residual adds), and the
            rotary embedding, final norm and LM head outside the layers (see ``paged_transformers.compilation``);
            Dynamo and Inductor make an engine with compiled layers build several times slower than one with the
            fused eager layers (``docs/behaviour.md``). None (default): on CUDA, Llama, Mistral and Qwen2 layers run
            the fused eager layers (``fuse_projections``), which decode about as fast without a compiler; other
            models, and every model with ``fuse_projections=False``, are compiled exactly when CUDA graphs are on
            (CUDA, Triton attention, not ``enforce_eager``). True: compile whatever the model. False: never compile.
        fuse_projections: compute q|k|v and gate|up as one GEMM each over a concatenated weight
            (``paged_transformers.compilation.fusion``; memory neutral, undone on close): in the fused eager decoder
            layers (``compilation.fused_layers``: Llama, Mistral and Qwen2 layers with hand-fused RMSNorm, rotary and
            SiLU-and-mul Triton kernels, no ``torch.compile``), or in the compiled layers. None (default): on, with
            the fused eager layers on CUDA where they run the model (else with compiled layers, or the model's own
            forward). False: neither the fusion nor the fused eager layers. True on a model that the fused eager
            layers cannot run, when its layers are not compiled (or on a CPU without the Triton interpreter), is a
            ValueError at engine start.
        async_scheduling: schedule and launch a decode step before the previous step's sampled tokens
            reach the host, its input ids copied on the device from that step's sampled tokens; the host
            then reads and processes the previous step's tokens while the new one runs (vLLM V1's
            ``async_scheduling``, SGLang's overlap scheduler). Steps with admissions, n > 1 forks, a
            possible length finish, host-side sampling work (penalties, logits processors, min_tokens)
            or too few free blocks run synchronously. Outputs are the same as with False, the
            synchronous loop (``LLMEngine.step``), for greedy and seeded requests; unseeded random
            sampling draws from the global generator in another order, so its tokens differ.
        cpu_prepack_weights: give the eager fp32 CPU projections (oneDNN, on x86-64; ``paged_transformers.core.cpu_linear``)
            packed copies of their weights in oneDNN's blocked layout, which oneDNN otherwise reorders at every
            product, so batched decode gains most (up to 1.44x faster for patched ``generate()`` at batch 8).
            Costs a second copy of every fp32 ``nn.Linear`` weight (a tied LM head included) and a reorder of each
            weight whenever they are packed. None (default): pack at a call whose weights are unchanged since
            the previous call (an evaluation loop packs at its second call), and drop the packs, freeing the
            memory, at the first call that sees them changed (so a loop that steps an optimizer between calls
            never packs); never at an engine's first call. False: never. True: pack at engine start too, and
            again after every change. Ignored where the oneDNN route does not apply (CUDA, compiled layers,
            other dtypes). ``sleep()``, ``close()`` and ``reset_prefix_cache()`` drop the packs.
        tensor_parallel_size: ranks the model's attention heads and MLP are split over (Megatron's column / row
            split, one all-reduce after the attention output and after the MLP; ``paged_transformers.distributed``).
            1 (default): one process. ``LLM(path, tensor_parallel_size=N)`` starts the other ranks itself;
            ``LLMEngine`` takes only 1 (the sharded engines are ``paged_transformers.distributed``'s).

    Raises:
        ValueError: a field out of range, naming the field and the value.

    Examples:
        >>> from paged_transformers import EngineConfig
        >>> cfg = EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
        >>> cfg.attention_backend
        <AttentionBackend.AUTO: 'auto'>
        >>> EngineConfig(block_size=0)
        Traceback (most recent call last):
        ...
        ValueError: block_size must be a positive integer, got 0
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_cudagraph_capture_size: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention_backend: AttentionBackend | str = AttentionBackend.AUTO
    enforce_eager: bool = False
    compile_layers: bool | None = None
    fuse_projections: bool | None = None
    async_scheduling: bool = True
    cpu_prepack_weights: bool | None = None
    tensor_parallel_size: int = 1
    usage_context: UsageContext | str = UsageContext.LLM_CLASS

    CPU_DEFAULT_KV_BYTES = 1 << 30

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field; ``attention_backend`` and ``usage_context`` are parsed into their enums in place.

        Run at construction and again by ``LLMEngine`` (on its own copy), so a field changed after
        construction (``cfg.block_size = 0``) gets the same ValueError.

        Raises:
            ValueError: a field of the wrong type or out of range, naming the field and the value.
        """
        for name in ("block_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_gpu_blocks", "kv_cache_memory_bytes", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "max_cudagraph_capture_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("compile_layers", "fuse_projections", "cpu_prepack_weights"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
        if isinstance(self.max_model_len, int) and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt token and one output token), got {self.max_model_len}")
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        try:
            self.attention_backend = AttentionBackend(self.attention_backend)
        except ValueError:
            allowed = [b.value for b in AttentionBackend]
            raise ValueError(f"attention_backend must be one of {allowed}, got {self.attention_backend!r}") from None
        try:
            self.usage_context = UsageContext(self.usage_context)
        except ValueError:
            allowed = [c.value for c in UsageContext]
            raise ValueError(f"usage_context must be one of {allowed}, got {self.usage_context!r}") from None
