"""Parse a checkpoint's quantization settings (``quantization_config`` in config.json, or
``quantize_config.json``) into a ``QuantizationConfig``; refuse formats we do not read.

Supported:

* GPTQ v1 (``quant_method: gptq``, ``checkpoint_format``/``format`` ``gptq``, as GPTQModel, AutoGPTQ
  and optimum write it): bits 4 or 8, any ``group_size`` (-1 = per channel), ``desc_act``, sym/asym.
* AWQ GEMM (``quant_method: awq``, ``version: gemm``, as AutoAWQ writes it): bits 4, zero point.

Everything else (``gptq_v2``, ``marlin``, ``bitblas``, AWQ ``gemv``/``exllama``/``marlin``, 2/3-bit,
other quant methods) raises ``NotImplementedError`` naming the unsupported value.
"""

import enum
import json
import os
from dataclasses import dataclass


class QuantMethod(enum.Enum):
    """The checkpoint format family."""

    GPTQ = "gptq"
    AWQ = "awq"


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """What the loader needs to know about a quantized checkpoint.

    Attributes:
        method: ``QuantMethod.GPTQ`` (v1 layout) or ``QuantMethod.AWQ`` (GEMM layout).
        bits: 4 or 8 (AWQ: 4).
        group_size: input rows per scale group; -1 means one group over the whole input (per channel).
        desc_act: GPTQ act-order; ``g_idx`` is then a real permutation of groups.
        sym: GPTQ symmetric (the stored zero is ``2**(bits-1) - 1``); informative, since v1 stores
            the zeros either way.
        modules_to_not_convert: module names left in full precision by the config (AWQ); the
            checkpoint itself decides which modules are quantized (those with a ``.qweight``).
    """

    method: QuantMethod
    bits: int
    group_size: int
    desc_act: bool = False
    sym: bool = True
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self):
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 or positive, got {self.group_size}")

    @classmethod
    def from_dict(cls, cfg: dict) -> "QuantizationConfig":
        """Parse a ``quantization_config`` / ``quantize_config.json`` dict.

        Raises:
            NotImplementedError: an unsupported ``quant_method``, GPTQ ``checkpoint_format``,
                AWQ ``version``, bit width, ``pack_dtype`` or option (the value is named).
            ValueError: a malformed field.
        """
        method = str(cfg.get("quant_method", "gptq")).lower()
        if method == "gptq":
            return cls._from_gptq(cfg)
        if method == "awq":
            return cls._from_awq(cfg)
        raise NotImplementedError(f"quant_method {method!r} is not supported (supported: 'gptq' v1, 'awq' gemm)")

    @classmethod
    def _from_gptq(cls, cfg: dict) -> "QuantizationConfig":
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if cfg.get("is_marlin_format"):
            fmt = "marlin"
        if fmt != "gptq":
            raise NotImplementedError(f"GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq', i.e. v1)")
        bits = int(cfg.get("bits", 4))
        if bits not in (4, 8):
            raise NotImplementedError(f"GPTQ with bits={bits} ({bits}-bit) is not supported (4 or 8)")
        pack_dtype = str(cfg.get("pack_dtype", "int32")).replace("torch.", "")
        if pack_dtype != "int32":
            raise NotImplementedError(f"GPTQ pack_dtype {pack_dtype!r} is not supported (int32)")
        if cfg.get("dynamic"):
            raise NotImplementedError(f"GPTQ per-module 'dynamic' overrides are not supported: {cfg['dynamic']!r}")
        return cls(
            method=QuantMethod.GPTQ,
            bits=bits,
            group_size=int(cfg.get("group_size", 128)),
            desc_act=bool(cfg.get("desc_act", False)),
            sym=bool(cfg.get("sym", True)),
            modules_to_not_convert=tuple(cfg.get("modules_to_not_convert") or ()),
        )

    @classmethod
    def _from_awq(cls, cfg: dict) -> "QuantizationConfig":
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise NotImplementedError(f"AWQ version {version!r} is not supported (only 'gemm')")
        bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        if bits != 4:
            raise NotImplementedError(f"AWQ with bits={bits} ({bits}-bit) is not supported (4)")
        if not cfg.get("zero_point", True):
            raise NotImplementedError("AWQ with zero_point=False is not supported")
        return cls(
            method=QuantMethod.AWQ,
            bits=4,
            group_size=int(cfg.get("group_size", cfg.get("q_group_size", 128))),
            sym=False,
            modules_to_not_convert=tuple(cfg.get("modules_to_not_convert") or ()),
        )


def read_quantization_config(folder: str | os.PathLike, config_dict: dict) -> QuantizationConfig | None:
    """The checkpoint's quantization settings, or None for a plain (unquantized) checkpoint.

    ``config_dict["quantization_config"]`` wins; else ``quantize_config.json`` in ``folder`` (older
    AutoGPTQ checkpoints have only that file).

    Raises:
        NotImplementedError / ValueError: see ``QuantizationConfig.from_dict``.
    """
    cfg = config_dict.get("quantization_config")
    if cfg is None:
        path = os.path.join(folder, "quantize_config.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            cfg = json.load(f)
    return QuantizationConfig.from_dict(cfg)
