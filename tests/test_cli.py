"""The ``paged-transformers generate`` command: the embedded default model end to end, and user mistakes
ending as one ``error:`` line with exit status 2 (no traceback)."""

import pytest

from paged_transformers.cli import main


def test_generate_default_model_mentions_paris(smollm2, capsys):
    status = main(["generate", "--max-tokens", "8", "The capital of France is"])
    out = capsys.readouterr().out
    assert status == 0
    assert "Paris" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("requests: 1 | prompt tokens: 5 |") and "peak KV blocks used:" in summary


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "/nonexistent/model", "hi"], "no such model folder"),
        (["generate", "--prompts-file", "/nonexistent/prompts.txt"], "No such file"),
        (["generate", "--device", "nodevice", "hi"], "nodevice"),
        (["generate", "--max-tokens", "0", "--model", ".", "hi"], None),  # '.' has no config.json: an OSError
    ],
    ids=["model-path", "prompts-file", "device", "model-folder-without-config"],
)
def test_user_mistakes_end_as_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    if message:
        assert message in err[0]


def test_empty_prompts_file(tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("\n   \n")
    assert main(["generate", "--prompts-file", str(path)]) == 2
    assert "no prompts" in capsys.readouterr().err
