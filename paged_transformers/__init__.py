"""paged-transformers: a paged KV cache, PagedAttention kernels and continuous batching for
Hugging Face transformers models.

Public API::

    from paged_transformers import paged_generate, SamplingParams, EngineConfig, LLMEngine, PagedCache
    import paged_transformers; paged_transformers.patch()   # model.generate() through the engine
    from paged_transformers import engine_for, release       # the model's warm engine; free it
"""

from pathlib import Path as _Path

from ._source_tree import map_source_folders as _map_source_folders

_map_source_folders(__name__, _Path(__file__).resolve().parent)  # before any import of .kernels or .patches

from .integration.cache import PagedCache  # noqa: E402
from .config import AttentionBackend, EngineConfig
from .core.engine import LLMEngine
from .integration.generate import paged_generate
from .entrypoints.llm import LLM, ModelEngine
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .integration.generation_config import PerRequest
from .patches.generate import patch, unpatch
from .quantization import load_model
from .integration.warm import engine_for, release

__version__ = "0.1.0"

__all__ = [
    "AttentionBackend",
    "CompletionOutput",
    "EngineConfig",
    "LLM",
    "LLMEngine",
    "ModelEngine",
    "PagedCache",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "PerRequest",
    "engine_for",
    "load_model",
    "paged_generate",
    "patch",
    "release",
    "unpatch",
]
