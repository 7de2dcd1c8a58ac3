"""Training data end to end: bad --data stops hethub train before any process starts (the
formats, batches and refusals themselves: tests/test_corpus.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_train_refuses_bad_data_before_starting_any_process(tmp_path):
    (tmp_path / "c.yaml").write_text("groups: [{name: g, accelerator: cpu, devices_per_node: 2}]\n")
    (tmp_path / "p.yaml").write_text(
        "model: tiny-llama\nglobal_batch: 2\npipelines: [{stages: [{group: g, layers: 8}]}]\n"
    )
    (tmp_path / "short.txt").write_text("too short")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hethub",
            "train",
            "--cluster",
            "c.yaml",
            "--plan",
            "p.yaml",
            "--data",
            "short.txt",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        done.returncode == 2
        and "shorter than one batch" in done.stderr
        and "Traceback" not in done.stderr
    )
    assert done.stderr.count("\n") == 1
