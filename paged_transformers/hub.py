"""``resolve_model_path``: a local folder or a Hugging Face hub id, as a local checkpoint folder, failing in
seconds with a message that names the model when it is neither a folder nor reachable.

Loading a hub id straight through ``from_pretrained`` with no network retries each file for ~25 s
(HEAD requests with backoff) and then blames the tokenizer; here the local cache is read first, offline
mode is honoured, and one request with a timeout tells a missing model from an unreachable hub.
"""

import os

# What a causal LM checkpoint needs: config and generation config, weights, tokenizer files, chat template.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
HUB_TIMEOUT_S = 10.0  # the one reachability request (huggingface_hub's own etag timeout is 10 s too)


def resolve_model_path(model_id: str | os.PathLike) -> str:
    """The local folder of a checkpoint: ``model_id`` itself when it is a folder, else the hub repo of that
    id, from the local hub cache when offline (``HF_HUB_OFFLINE=1``) or when the hub cannot be reached,
    else downloaded (``CHECKPOINT_FILES`` only) with ``huggingface_hub.snapshot_download``.

    Online, one request with a ``HUB_TIMEOUT_S`` timeout checks the repo first, so that no route to the hub
    fails in seconds instead of after the download's retries.

    Raises:
        ValueError: naming ``model_id``: a path that does not exist (a ``Path`` is always taken for a folder) or
            is a file, an id that is not
            in the local cache while offline or while the hub cannot be reached, or an id the hub does
            not have (or that is private or gated without a login).
    """
    path = os.path.expanduser(os.fspath(model_id))
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"model {path!r} is a file, not a checkpoint folder")
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    missing = f"model {path!r}: no such model folder (the folder does not exist, and it is not a hub id)"
    if isinstance(model_id, os.PathLike):  # a Path always means a folder
        raise ValueError(missing)
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise ValueError(missing) from None
    try:
        cached = snapshot_download(path, local_files_only=True)
    except LocalEntryNotFoundError:
        cached = None
    if constants.HF_HUB_OFFLINE:
        if cached is None:
            raise ValueError(
                f"model {path!r} is not available offline: it is neither a local folder nor in the local hub "
                f"cache ({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set"
            )
        return cached
    try:
        HfApi().model_info(path, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise ValueError(f"model {path!r}: no such model on the hub (or it is private or gated: log in)") from None
    # NOTE: the transport errors (no route, DNS, refused, timeout) are classes of the HTTP client that
    # huggingface_hub uses (httpx or another, by version), with no common base to name here.
    except Exception as e:
        if cached is None:
            raise ValueError(
                f"model {path!r} is not available offline: the hub cannot be reached ({type(e).__name__}: {e}) "
                f"and it is not in the local hub cache ({constants.HF_HUB_CACHE})"
            ) from e
        return cached
    return snapshot_download(path, allow_patterns=CHECKPOINT_FILES)
