"""Training data: the formats --data takes, the seeded batches, and the clear errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from hethub.corpus import open_corpus
from hethub.errors import HethubError
from hethub.runtime.data import builtin_corpus, check_tokens, global_batch, load_tokens


def test_builtin_corpus_is_byte_tokens_of_the_pydoc_texts():
    tokens = builtin_corpus()
    assert len(tokens) > 100_000 and int(tokens.max()) < 256 and tokens.dtype == torch.long


def test_the_runtime_s_built_in_corpus_is_the_corpus_package_s():
    corpus = open_corpus(None)
    tokens = builtin_corpus()
    assert len(tokens) == len(corpus)
    assert torch.equal(tokens[:257], corpus.consecutive(0, 1, 256)[0])


def test_text_file_folder_and_bin(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    assert load_tokens(tmp_path / "a.txt").tolist() == list(b"hello")
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "2.txt").write_text("world")
    (folder / "1.md").write_text("hi")
    (folder / "skip.png").write_bytes(b"\x89PNG")
    assert load_tokens(folder).tolist() == list(b"hi\n\nworld")
    np.array([1, 2, 65535], dtype=np.uint16).tofile(tmp_path / "train.bin")
    assert load_tokens(tmp_path / "train.bin").tolist() == [1, 2, 65535]


def test_batches_are_seeded_and_plan_independent():
    corpus = torch.arange(1000)
    a, b = global_batch(corpus, 3, 4, 16, seed=5), global_batch(corpus, 3, 4, 16, seed=5)
    assert torch.equal(a, b) and a.shape == (4, 17)
    assert not torch.equal(a, global_batch(corpus, 4, 4, 16, seed=5))
    assert torch.equal(
        a[:, 1:] - a[:, :-1], torch.ones(4, 16, dtype=torch.long)
    )  # contiguous windows


@pytest.mark.parametrize(
    "setup,needle",
    [
        (lambda p: p / "missing.txt", "no such file or folder"),
        (lambda p: (p / "empty.txt").write_text("") or p / "empty.txt", "empty"),
        (lambda p: (p / "d").mkdir() or p / "d", "no text files"),
    ],
)
def test_bad_data_is_one_clear_error(tmp_path, setup, needle):
    with pytest.raises(HethubError, match=needle):
        load_tokens(setup(tmp_path))


def test_data_shorter_than_a_batch_or_beyond_the_vocabulary_is_refused():
    with pytest.raises(HethubError, match="shorter than one batch"):
        check_tokens(torch.zeros(20, dtype=torch.long), "x", 256, 16, 8)
    with pytest.raises(HethubError, match="outside the model's vocabulary of 256"):
        check_tokens(torch.full((100,), 300), "x", 256, 16, 2)


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
