"""Native GPTQ (v1) and AWQ (GEMM) checkpoints: config parsing, packed-format decoding, the
``QuantLinear`` module and ``load_model``; ``build_random_quantized_model`` for benchmarks."""

from .config import QuantizationConfig, QuantMethod, read_quantization_config
from .formats import PackedWeight, awq_to_kernel_layout, dequantize_awq, dequantize_gptq, gptq_to_kernel_layout
from .linear import QuantLinear
from .loader import load_model
from .random_model import build_random_quantized_model

__all__ = [
    "PackedWeight",
    "QuantLinear",
    "QuantMethod",
    "QuantizationConfig",
    "awq_to_kernel_layout",
    "build_random_quantized_model",
    "dequantize_awq",
    "dequantize_gptq",
    "gptq_to_kernel_layout",
    "load_model",
    "read_quantization_config",
]
