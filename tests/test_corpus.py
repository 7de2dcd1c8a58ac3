"""Corpora as --data names them: the formats opened (a Megatron-LM index written here from the
format's description), windows in a seeded order that shows every window once an epoch and
depends on nothing but (first, count, seed), blends in their proportions, evaluation's windows
in document order, memory that does not grow with the corpus, and every refusal in one line."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from hethub.corpus import BlendedCorpus, absolute_spec, open_corpus
from hethub.corpus.indexed import IndexedWriter
from hethub.corpus.windows import BLEND_BLOCK
from hethub.errors import HethubError


def megatron(prefix: Path, documents: list[np.ndarray], code: int = 4) -> Path:
    """A .bin/.idx pair written from the format's description, not with hethub's writer."""
    dtype = np.dtype({4: np.int32, 8: np.uint16}[code])
    lengths = np.array([len(d) for d in documents], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * dtype.itemsize])
    with open(f"{prefix}.idx", "wb") as idx:
        idx.write(
            struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, code, len(lengths), len(lengths) + 1)
        )
        idx.write(lengths.tobytes() + pointers.astype(np.int64).tobytes())
        idx.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    Path(f"{prefix}.bin").write_bytes(b"".join(d.astype(dtype).tobytes() for d in documents))
    return prefix


def counting(path: Path, tokens: int, start: int = 0) -> Path:
    """nanoGPT's .bin holding start, start + 1, ...: a window's first token says where it is."""
    np.arange(start, start + tokens, dtype=np.uint16).tofile(path)
    return path


def test_a_megatron_prefix_is_read_in_any_of_its_three_names(tmp_path):
    docs = [np.array([5, 6, 7]), np.array([150_000, 9]), np.array([1, 2, 3, 4])]
    prefix = megatron(tmp_path / "wiki_text_document", docs)
    for spec in (prefix, f"{prefix}.bin", f"{prefix}.idx"):
        corpus = open_corpus(spec)
        assert len(corpus) == 9 and corpus.tokenizer_dir is None
        assert corpus.consecutive(0, 9, 2).tolist() == [
            [5, 6, 7],
            [7, 150_000, 9],
            [9, 1, 2],
            [2, 3, 4],
        ]  # documents packed across their ends; the last window ends with the data
    corpus.check(151_936, 2, 4)  # a 32-bit vocabulary
    with pytest.raises(HethubError, match="token 150000 is outside the model's vocabulary of 128"):
        corpus.check(128, 2, 4)


def test_hethub_s_writer_matches_the_format_byte_for_byte(tmp_path):
    docs = [np.array([3, 1, 4], np.uint16), np.array([1, 5], np.uint16)]
    writer = IndexedWriter(tmp_path / "ours", np.dtype(np.uint16))
    writer.add_documents(np.concatenate(docs), np.array([3, 2]))
    writer.finish()
    megatron(tmp_path / "theirs", docs, code=8)
    for suffix in (".bin", ".idx"):
        ours, theirs = (tmp_path / f"ours{suffix}"), (tmp_path / f"theirs{suffix}")
        assert ours.read_bytes() == theirs.read_bytes()


def test_windows_are_consecutive_slices_overlapping_by_one_token(tmp_path):
    corpus = open_corpus(counting(tmp_path / "train.bin", 1001))
    rows = corpus.batch(0, 8, 100, seed=1)
    assert rows.dtype == torch.long and rows.shape == (8, 101)
    assert (rows[:, 0] % 100 == 0).all()  # window i starts at i * seq_len
    assert torch.equal(rows, rows[:, :1] + torch.arange(101))
    assert corpus.consecutive(8, 5, 100)[:, 0].tolist() == [800, 900]  # fewer where it ends


def test_every_window_is_seen_once_an_epoch_and_epochs_follow_each_other(tmp_path):
    corpus = open_corpus(counting(tmp_path / "train.bin", 64 * 10 + 1))
    assert corpus.windows(64) == 10
    firsts = (corpus.batch(0, 30, 64, seed=3)[:, 0] // 64).tolist()
    epochs = [firsts[e * 10 : e * 10 + 10] for e in range(3)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3  # each epoch shuffled anew


def test_a_batch_depends_on_first_count_and_seed_alone(tmp_path):
    path = counting(tmp_path / "train.bin", 5000)
    whole = open_corpus(path).batch(40, 12, 16, seed=7)
    again = open_corpus(path)  # a fresh process's view: another rank, a resumed run
    pieces = [again.batch(48, 4, 16, seed=7), again.batch(40, 8, 16, seed=7)]  # any split
    assert torch.equal(whole, torch.cat([pieces[1], pieces[0]]))
    assert not torch.equal(whole, again.batch(40, 12, 16, seed=8))
    far = again.batch(10**9, 2, 16, seed=7)  # any position costs one epoch's order
    assert far.shape == (2, 17)


def test_a_blend_deals_each_part_its_share_and_shuffles_each_on_its_own(tmp_path):
    a = counting(tmp_path / "a.bin", 8 * 500 + 1)
    b = counting(tmp_path / "b.bin", 8 * 300 + 1, start=10_000)
    blend = open_corpus(f"0.7:{a},0.3:{b}")
    assert isinstance(blend, BlendedCorpus) and len(blend) == 8 * 800 + 2
    rows = blend.batch(0, BLEND_BLOCK, 8, seed=0)
    from_b = rows[:, 0] >= 10_000
    assert int(from_b.sum()) == 3000  # exactly its share of every block
    assert 250 <= int(from_b[:1000].sum()) <= 350  # and near it in a shorter run
    firsts_a = (rows[~from_b][:, 0] // 8).tolist()
    assert sorted(firsts_a[:500]) == list(range(500))  # a's windows once its epoch
    assert torch.equal(rows[123:131], blend.batch(123, 8, 8, seed=0))
    blend.check(65_536, 8, 64)
    weights = open_corpus(f"7:{a},3:{b}").batch(0, 100, 8, seed=0)  # weights are normalised
    assert torch.equal(weights, rows[:100])


def test_text_and_the_built_in_corpus_are_bytes(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "2.txt").write_text("world")
    (folder / "1.md").write_text("hi")
    (folder / "skip.png").write_bytes(b"\x89PNG")
    assert bytes(open_corpus(folder).consecutive(0, 1, 8)[0].tolist()) == b"hi\n\nworld"
    (tmp_path / "README").write_text("no suffix, but text")
    assert len(open_corpus(tmp_path / "README")) == 19
    builtin = open_corpus(None)
    assert builtin.name == "the built-in corpus" and len(builtin) > 100_000
    builtin.check(256, 128, 64)
    with pytest.raises(HethubError, match="outside the model's vocabulary of 100"):
        builtin.check(100, 128, 64)


def test_reading_batches_does_not_keep_the_corpus_resident(tmp_path):
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs Linux's /proc")

    def resident_file_kb() -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith("RssFile"))
        return int(line.split()[1])

    np.resize(np.arange(50_000, dtype=np.uint16), 32 << 20).tofile(tmp_path / "big.bin")  # 64 MB
    corpus = open_corpus(tmp_path / "big.bin")
    before = resident_file_kb()
    for step in range(200):
        corpus.batch(step * 16, 16, 128, seed=0)
    corpus.check(60_000, 128, 16)  # scans every token
    assert resident_file_kb() - before < 8 << 10  # under 8 MB of the 64 MB stays mapped


def test_a_blend_s_paths_are_made_absolute_part_by_part(tmp_path):
    counting(tmp_path / "a.bin", 100)
    assert absolute_spec("a.bin", tmp_path) == str(tmp_path / "a.bin")
    assert absolute_spec("2:a.bin,1:b/c", tmp_path) == f"2.0:{tmp_path}/a.bin,1.0:{tmp_path}/b/c"


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "setup, needle",
    [
        (lambda p: _write(p / "c.jsonl", b'{"text": "a"}\n'), "run `hethub data prepare` first"),
        (lambda p: _write(p / "c.parquet", b"PAR1"), "for raw .jsonl or .parquet"),
        (lambda p: _write(p / "c.json", b"{}"), "not a corpus hethub reads; --data takes a"),
        (lambda p: _write(p / "c.npy", b"\x93NUMPY"), "Megatron-LM PREFIX"),
        (lambda p: _write(p / "c.txt.gz", b"\x1f\x8b\x08\x00"), "gzip-compressed"),
        (lambda p: _write(p / "c.txt", b"\x28\xb5\x2f\xfd"), "zstd-compressed"),
        (lambda p: _write(p / "c.bin", b"abc"), "not whole uint16 tokens"),
        (lambda p: _write(p / "c.txt", b""), "empty, no tokens"),
        (lambda p: _write(p / "c.idx", b"MMIDIDX"), "without its c.bin"),
        (lambda p: (_write(p / "c.idx", b"x" * 40), _write(p / "c.bin", b""))[0], "no MMIDIDX"),
        (lambda p: p / "missing.txt", "no such file or folder"),
        (lambda p: (p / "d").mkdir() or p / "d", "no text files"),
        (lambda p: (p / "d").mkdir() or _write(p / "d" / "metadata.json", b"{}").parent, "lacks"),
        (lambda p: f"0.5:{counting(p / 'a.bin', 9)},x:{p}/b.bin", "'x:"),
        (lambda p: f"1:{counting(p / 'a.bin', 9)},1:{_write(p / 'b.txt', b'hi')}", "text (bytes)"),
        (lambda p: f"1:{counting(p / 'a.bin', 9)},0.00001:{p / 'a.bin'}", "below the 1/10000"),
    ],
)
def test_bad_data_is_refused_in_one_line(tmp_path, setup, needle):
    with pytest.raises(HethubError, match=None) as refused:
        open_corpus(setup(tmp_path))
    assert needle in str(refused.value) and "\n" not in str(refused.value)


def test_a_corpus_shorter_than_a_batch_is_refused(tmp_path):
    corpus = open_corpus(counting(tmp_path / "a.bin", 100))
    corpus.check(65_536, 16, 6)
    with pytest.raises(HethubError, match="100 tokens, shorter than one batch of 7 sequences"):
        corpus.check(65_536, 16, 7)
