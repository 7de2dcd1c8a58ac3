"""`hethub eval` of a HF folder: the loss transformers computes on the same consecutive windows,
for Llama (GQA, rope_theta 500000), Qwen2 (biases) and GPT-2 (tied, Conv1D), in fp32; --seq-len
and --sequences pick the windows; bad inputs are one line. A run folder's eval is
tests/test_export.py's (against its export)."""

from __future__ import annotations

import pytest
from test_export import hethub_json, transformers_loss
from test_hf_checkpoint import KINDS, TEXT, hf_folders

from hethub.cli import main

__all__ = ["hf_folders"]  # test_hf_checkpoint's fixture, used here

pytest.importorskip("transformers")


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text(TEXT)
    return path


def test_eval_of_a_hf_folder_is_transformers_loss(hf_folders, data, capsys):
    for kind in KINDS:
        ours = hethub_json(
            capsys, "eval", str(hf_folders[kind]), "--data", str(data), "--sequences", "4", "--json"
        )
        assert ours["tokens"] == 4 * 32  # windows of the model's max_position_embeddings
        theirs = transformers_loss(hf_folders[kind], data, 32).item()
        assert ours["loss"] == pytest.approx(theirs, rel=1e-5, abs=1e-5), kind
    shorter = hethub_json(
        capsys, "eval", str(hf_folders["llama"]), "--data", str(data), "--seq-len", "16", "--json"
    )
    assert shorter["tokens"] == 64 * 16  # the default number of windows
    capsys.readouterr()
    assert main(["eval", str(hf_folders["gpt2"]), "--data", str(data), "--sequences", "2"]) == 0
    assert capsys.readouterr().out.startswith("loss ")


def test_bad_inputs_are_one_line(hf_folders, data, tmp_path, capsys):
    def error(*argv) -> str:
        capsys.readouterr()
        assert main(list(argv)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    llama = str(hf_folders["llama"])
    said = error("eval", str(tmp_path), "--data", str(data))
    assert "neither a run folder (run.json) nor a HuggingFace model folder" in said
    said = error("eval", llama, "--data", str(data), "--step", "2")
    assert said.endswith(f"--step = 2: {llama} is a HuggingFace folder, not a run")
    said = error("eval", llama, "--data", str(data), "--seq-len", "64")
    assert "must be at most the model's max_position_embeddings (32)" in said
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert "9 tokens, shorter than one batch" in error("eval", llama, "--data", str(short))
