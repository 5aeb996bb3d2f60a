"""``hub.resolve_model_path`` and ``load_model`` on hub ids: a cached repo is used offline; a made-up id
offline, or with the hub unreachable, fails at once with a ``ValueError`` naming it (no download retries)."""

import pytest
from huggingface_hub import constants

from paged_transformers import load_model
from paged_transformers.hub import resolve_model_path

MADE_UP = "made-up-org/no-such-model-17"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE on, and an empty hub cache under ``tmp_path``; yields that cache folder."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_cached_repo_resolves_offline(offline):
    # the hub cache layout: models--ORG--NAME/refs/main holds the commit, snapshots/COMMIT the files
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline / "models--made-up-org--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    assert resolve_model_path("made-up-org/cached") == str(snapshot)


@pytest.mark.parametrize("load", [resolve_model_path, load_model], ids=["resolve_model_path", "load_model"])
def test_uncached_id_offline_names_it(offline, load):
    with pytest.raises(ValueError, match=f"'{MADE_UP}' is not available offline.*HF_HUB_OFFLINE"):
        load(MADE_UP)


def test_missing_folder_and_file(tmp_path):
    with pytest.raises(ValueError, match="no such model folder"):
        resolve_model_path(tmp_path / "missing" / "model")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(tmp_path / "weights.bin")
    assert resolve_model_path(tmp_path) == str(tmp_path)
