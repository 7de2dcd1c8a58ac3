"""`hethub data prepare`: the tokens it writes are the tokenizers library's own encoding plus EOS,
in Megatron-LM's indexed format as its description reads (a reader written here from it), for
every kind of input; bad input is one line."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hethub.corpus import open_corpus
from hethub.corpus.prepare import prepare
from hethub.errors import HethubError

TEXTS = [topics[key] for key in sorted(topics)]
EOS = "<|endoftext|>"


def bpe(folder: Path, *, bos: bool = False, config: bool = True) -> Path:
    """A byte-level BPE of 300 tokens trained on a few KB of the pydoc texts, saved as a
    HuggingFace folder; with ``bos`` its post-processor starts each document with <s>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS, "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS[:40], trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
        )
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    if config:
        settings = {"eos_token": EOS, **({"bos_token": {"content": "<s>"}} if bos else {})}
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "generation_config.json").write_text('{"eos_token_id": 0}')
    return folder


def read_indexed(prefix: Path) -> tuple[np.dtype, list[np.ndarray]]:
    """Megatron-LM's .idx/.bin read from the format's description alone: magic, version 1,
    dtype code, sequence count, document count; int32 lengths, int64 byte pointers, int64
    document indices."""
    data = (prefix.parent / (prefix.name + ".idx")).read_bytes()
    magic, version, code, sequences, documents = struct.unpack_from("<9sQBQQ", data)
    assert magic == b"MMIDIDX\x00\x00" and version == 1
    dtype = np.dtype({8: np.uint16, 4: np.int32}[code])
    offset = 34
    lengths = np.frombuffer(data, np.int32, sequences, offset)
    pointers = np.frombuffer(data, np.int64, sequences, offset + 4 * sequences)
    doc_index = np.frombuffer(data, np.int64, documents, offset + 12 * sequences)
    assert len(data) == offset + 12 * sequences + 8 * documents
    assert doc_index.tolist() == list(range(sequences + 1))  # one sequence per document
    blob = (prefix.parent / (prefix.name + ".bin")).read_bytes()
    assert len(blob) == int(lengths.sum()) * dtype.itemsize
    docs = [np.frombuffer(blob, dtype, n, p) for n, p in zip(lengths.tolist(), pointers.tolist())]
    return dtype, docs


def expected(tokenizer_dir: Path, texts: list[str]) -> list[list[int]]:
    """What the tokenizers library itself makes of the documents, EOS after each."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS)
    return [e.ids + [eos] for e in tokenizer.encode_batch(texts)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bpe(tmp_path_factory.mktemp("tok") / "gpt")


def test_tokens_are_the_tokenizers_encoding_plus_eos_for_every_kind_of_input(
    tmp_path, tokenizer_dir
):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "b.md").write_text(TEXTS[1])
    (folder / "a.txt").write_text(TEXTS[0])
    (folder / "notes.png").write_bytes(b"\x89PNG")  # not text: skipped in a folder
    with open(tmp_path / "c.jsonl", "w") as lines:
        lines.writelines(json.dumps({"text": text, "id": 1}) + "\n" for text in TEXTS[2:6])
        lines.write("\n")  # a blank line is no document
    pq.write_table(pa.table({"body": TEXTS[6:9]}), tmp_path / "d.parquet")
    inputs = [str(folder), str(tmp_path / "c.jsonl"), str(tmp_path / "d.parquet")]
    order = TEXTS[:9]

    done = prepare(str(tokenizer_dir), inputs[:2], tmp_path / "out", workers=2)
    dtype, docs = read_indexed(tmp_path / "out" / "tokens")
    assert dtype == np.uint16 and [d.tolist() for d in docs] == expected(tokenizer_dir, order[:6])
    assert (done.documents, done.tokens) == (6, sum(len(d) for d in docs))

    # a .parquet's column (--field), and one process against two: the same bytes
    prepare(str(tokenizer_dir), [inputs[2]], tmp_path / "pq", field="body", workers=1)
    assert [d.tolist() for d in read_indexed(tmp_path / "pq" / "tokens")[1]] == expected(
        tokenizer_dir, order[6:]
    )
    prepare(str(tokenizer_dir), inputs[:2], tmp_path / "one", workers=1)
    for name in ("tokens.bin", "tokens.idx"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "out" / name).read_bytes()

    metadata = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert metadata == {
        "tokenizer": str(tokenizer_dir),
        "tokenizer_sha256": metadata["tokenizer_sha256"],
        "vocab": 300,
        "eos": 0,
        "bos": None,
        "documents": 6,
        "tokens": done.tokens,
        "dtype": "uint16",
    }
    copied = sorted(p.name for p in (tmp_path / "out" / "tokenizer").iterdir())
    assert copied == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]

    corpus = open_corpus(tmp_path / "out")  # --data takes the folder
    assert len(corpus) == done.tokens and corpus.tokenizer_dir == tmp_path / "out" / "tokenizer"
    assert corpus.consecutive(0, 1, 16)[0].tolist() == docs[0][:17].tolist()


def test_a_post_processor_s_bos_is_kept_and_the_metadata_names_it(tmp_path):
    folder = bpe(tmp_path / "llama", bos=True)
    prepare(str(folder / "tokenizer.json"), [str(_text(tmp_path, TEXTS[0]))], tmp_path / "out")
    bos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<s>")
    (doc,) = read_indexed(tmp_path / "out" / "tokens")[1]
    assert doc[0] == bos and doc.tolist() == expected(folder, TEXTS[:1])[0]
    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["bos"] == bos


def test_a_vocabulary_beyond_uint16_is_written_as_int32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate([EOS, *words])}, EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    text = "w3 w65600 w69999 w7"
    prepare(str(tmp_path / "tok"), [str(_text(tmp_path, text))], tmp_path / "out", eos=EOS)
    dtype, (doc,) = read_indexed(tmp_path / "out" / "tokens")
    assert dtype == np.int32 and doc.tolist() == [4, 65601, 70000, 8, 0]
    corpus = open_corpus(tmp_path / "out")
    assert corpus.consecutive(0, 1, 4)[0].tolist() == [4, 65601, 70000, 8, 0]
    corpus.check(70_001, 4, 1)
    with pytest.raises(HethubError, match="tokenizer of 70001 tokens, more than the model's"):
        corpus.check(65_536, 4, 1)


def _text(folder: Path, text: str) -> Path:
    path = folder / "doc.txt"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "setup, needle",
    [
        (lambda p, t: (t, [_file(p, "c.txt.gz", b"\x1f\x8b\x08")], {}), "not a format"),
        (lambda p, t: (t, [_file(p, "c.txt", b"\x28\xb5\x2f\xfd")], {}), "compressed"),
        (lambda p, t: (t, [_file(p, "c.json", b"{}")], {}), ".jsonl and .parquet"),
        (lambda p, t: (t, [str(p / "none.txt")], {}), "no such file"),
        (lambda p, t: (t, [_file(p, "c.jsonl", b'{"text": "a"}\n{"text": 3\n')], {}), "c.jsonl:2"),
        (lambda p, t: (t, [_file(p, "c.jsonl", b'{"body": "a"}\n')], {}), "no 'text' field"),
        (lambda p, t: (t, [_file(p, "c.txt", b"hi")], {"eos": "<nope>"}), "not a token"),
        (lambda p, t: (str(p), [_file(p, "c.txt", b"hi")], {}), "no tokenizer.json"),
        (
            lambda p, t: (str(bpe(p / "t", config=False)), [_file(p, "c.txt", b"hi")], {}),
            "no eos_token",
        ),
    ],
)
def test_bad_input_is_one_line_and_leaves_no_folder(tmp_path, tokenizer_dir, setup, needle):
    tokenizer, inputs, flags = setup(tmp_path, str(tokenizer_dir))
    with pytest.raises(HethubError, match=needle) as refused:
        prepare(tokenizer, inputs, tmp_path / "out", workers=1, **flags)
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()


def _file(folder: Path, name: str, data: bytes) -> str:
    (folder / name).write_bytes(data)
    return str(folder / name)


def test_an_existing_folder_is_not_overwritten(tmp_path, tokenizer_dir):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(HethubError, match="exists and is not empty"):
        prepare(str(tokenizer_dir), [str(_text(tmp_path, "hi"))], tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_the_command_prints_one_summary_line_or_one_error_line(tmp_path, tokenizer_dir):
    def hethub(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "hethub", "data", "prepare", "--tokenizer"]
        return subprocess.run(
            [*command, str(tokenizer_dir), *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    _text(tmp_path, TEXTS[0])
    done = hethub("--input", "doc.txt", "--out", "out", "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("out: 1 documents, ") and "tokens/s" in done.stdout
    assert done.stdout.count("\n") == 1
    (tmp_path / "c.jsonl.gz").write_bytes(b"\x1f\x8b")
    refused = hethub("--input", "c.jsonl.gz", "--out", "out2")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("hethub data: error: --input = 'c.jsonl.gz'")
    assert refused.stderr.count("\n") == 1
