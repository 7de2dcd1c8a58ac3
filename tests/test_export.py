"""`hethub export`: a run trained across vendors (TP 2 on nv, TP 1 on amd), exported as a HF
folder, gives transformers the loss `hethub eval` gives of the run, for Llama, Qwen2 and GPT-2;
the folder has its configs, shards with their index and the prepared data's tokenizer files;
bad inputs are one line. The runs are tests/test_hf_checkpoint.py's (one job for all three)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_hf_checkpoint import KINDS, VOCAB, hf_folders, imported_runs
from test_hf_checkpoint import file_tensors as read_tensors

from hethub.cli import main
from hethub.corpus import open_corpus
from hethub.runtime.rundir import RunDir

__all__ = ["hf_folders", "imported_runs"]  # test_hf_checkpoint's fixtures, used here

transformers = pytest.importorskip("transformers")
SEQUENCES = 4


def hethub_json(capsys, *argv) -> dict:
    """`hethub ARGV` (exit 0) and the JSON object it printed last."""
    capsys.readouterr()
    assert main(list(argv)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def transformers_loss(folder, data, seq_len) -> float:
    """transformers' mean next-token loss of the HF folder on hethub eval's windows."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    windows = open_corpus(str(data)).consecutive(0, SEQUENCES, seq_len)
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), windows[:, 1:].flatten())


@pytest.mark.slow
def test_an_exported_run_gives_transformers_the_loss_hethub_eval_gives(
    imported_runs, tmp_path, capsys
):
    data = imported_runs["data"]
    for kind in KINDS:
        run = imported_runs[kind]["run"]
        out = tmp_path / kind
        capsys.readouterr()
        assert main(["export", str(run), "--out", str(out), "--dtype", "fp32"]) == 0
        said = capsys.readouterr().out
        assert f"exported step 2 of {run} to {out}" in said  # the newest checkpoint
        config = json.loads((out / "config.json").read_text())
        assert config["torch_dtype"] == "float32" and (out / "generation_config.json").is_file()
        ours = hethub_json(
            capsys, "eval", str(run), "--data", str(data), "--sequences", str(SEQUENCES), "--json"
        )
        theirs = transformers_loss(out, data, 32)
        assert ours["tokens"] == SEQUENCES * 32
        assert ours["loss"] == pytest.approx(theirs.item(), rel=1e-5, abs=1e-5), kind
        # the trained weights, not the imported ones
        imported = hethub_json(
            capsys, "eval", str(run), "--step", "0", "--data", str(data), "--json"
        )
        assert imported["loss"] != ours["loss"]


@pytest.mark.slow
def test_shards_dtype_and_the_tokenizer_of_prepared_data(imported_runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(imported_runs["llama"]["run"], run)
    prepared = tmp_path / "prepared"  # as `hethub data prepare` leaves a folder
    (prepared / "tokenizer").mkdir(parents=True)
    (prepared / "tokenizer" / "tokenizer.json").write_text('{"model": {}}')
    (prepared / "metadata.json").write_text(json.dumps({"eos": 7, "bos": None}))
    settings = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**settings, "data": str(prepared)}))
    out = tmp_path / "out"
    argv = ["export", str(run), "--out", str(out), "--step", "0", "--max-shard-size", "40KB"]
    assert main(argv) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert all((out / name).stat().st_size <= 40_000 for name in shards)
    assert (out / "tokenizer.json").read_text() == '{"model": {}}'
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 7}
    assert {t.dtype for t in read_tensors(out).values()} == {torch.bfloat16}  # the default


def test_bad_inputs_are_one_line(tmp_path, capsys):
    def error(*argv) -> str:
        capsys.readouterr()
        assert main(list(argv)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "--max-shard-size = 5XB: must be a positive size" in error(
        "export", "run", "--out", "o", "--max-shard-size", "5XB"
    )
    said = error("export", str(tmp_path), "--out", "o")
    assert said.endswith(f"{tmp_path}: not a run folder (no run.json in it)"), said
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    (run.path / "run.json").write_text(
        json.dumps(
            {"seed": 0, "lr": 1e-3, "data": None, "steps": 2, "checkpoint_every": 1, "timeout_s": 9}
        )
    )
    (run.path / "plan.yaml").write_text(
        "model: tiny-llama\nmicro_batch: 1\nglobal_batch: 1\npipelines:\n"
        "- count: 1\n  micro_batches: 1\n  stages:\n  - {group: nv, tp: 1, layers: 8}\n"
    )
    said = error("export", str(run.path), "--out", str(tmp_path / "o"))
    assert said.endswith(f"no checkpoint in {run.checkpoints}, nothing to export"), said
    assert "step-000004 does not exist" in error(
        "export", str(run.path), "--out", str(tmp_path / "o"), "--step", "4"
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (run.checkpoints / "step-000001").mkdir(parents=True)
    (run.checkpoints / "step-000001" / "meta.json").write_text('{"step": 1}')
    assert "exists and is not an empty folder" in error(
        "export", str(run.path), "--out", str(tmp_path / "full")
    )
