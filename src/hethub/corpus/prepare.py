"""``hethub data prepare``: raw text tokenized by a HuggingFace tokenizer (the ``tokenizers``
library) into a folder that ``--data`` takes:

    DIR/tokens.bin, DIR/tokens.idx   Megatron-LM's indexed format (corpus.indexed), one
                                     sequence per document; uint16 below a vocabulary of
                                     65,500, int32 from it
    DIR/metadata.json                tokenizer (as given), tokenizer_sha256 (of tokenizer.json),
                                     vocab, eos, bos (or null), documents, tokens, dtype
    DIR/tokenizer/                   tokenizer.json, and the tokenizer_config.json,
                                     special_tokens_map.json and generation_config.json beside it

Inputs: text files (one document each), folders of them (with .jsonl and .parquet files, in
name order), .jsonl (a document per line, its ``--field``) and .parquet (the ``--field``
column, read a record batch at a time). Compressed and unknown files are refused in one line.

Each document is encoded as the tokenizer encodes it by default, ``encode_batch(texts)`` with
``add_special_tokens=True``: its post-processor adds what it says (Llama 3's
<|begin_of_text|>; GPT-2's and Qwen2's add nothing), then the EOS token (tokenizer_config.json's
``eos_token``, else ``--eos``), unless the post-processor already ended the document with it.
A tokenizer.json's truncation and padding are switched off: they would cut or pad documents.
Empty documents are skipped, as Megatron's preprocess_data.py skips them.

The documents go in chunks of about CHUNK_BYTES to worker processes (each one encoding alone:
the processes are the parallelism) and come back in input order; at most two chunks per worker
are in flight, so memory stays bounded by the chunks, not the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from hethub.corpus.formats import COMPRESSED, COMPRESSED_SUFFIXES, TEXT_SUFFIXES
from hethub.corpus.indexed import IndexedWriter, token_dtype
from hethub.errors import HethubError
from hethub.files import write_atomic

CHUNK_BYTES = 1 << 20
"""Raw text per chunk of work: large enough that a chunk's pickling is small beside its
encoding, small enough that workers stay busy to the end."""
IN_FLIGHT_PER_WORKER = 2
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
"""Copied from the tokenizer's folder, where present, beside its tokenizer.json."""
INPUT_FORMATS = f"text files ({' '.join(TEXT_SUFFIXES)}), folders of them, .jsonl and .parquet"
PARALLELISM = "TOKENIZERS_PARALLELISM"
"""The tokenizers library's switch for its own threads: off in the worker processes."""


@dataclass(frozen=True)
class Chunk:
    """Documents on their way to a worker: texts, or a .jsonl's raw lines to decode there."""

    texts: list[str] | None
    lines: list[bytes] | None
    """A .jsonl's lines: decoded in the worker, their ``field`` the documents."""
    field: str
    source: str
    first_line: int
    size: int
    """Input bytes it covers, for the progress bar."""


@dataclass(frozen=True)
class Prepared:
    """What ``hethub data prepare`` wrote."""

    out: Path
    documents: int
    tokens: int
    seconds: float

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{self.out}: {self.documents:,} documents, {self.tokens:,} tokens in "
            f"{self.seconds:.1f} s ({rate:,.0f} tokens/s)"
        )


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer as given: its tokenizer.json, and the folder its other files are in."""

    given: str
    json_path: Path
    folder: Path | None

    def config(self) -> dict:
        path = self.folder / "tokenizer_config.json" if self.folder else None
        if path is None or not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except ValueError as error:
            raise HethubError(f"--tokenizer = {self.given!r}: {path.name}: {error}") from None


def tokenizer_source(given: str) -> TokenizerSource:
    """--tokenizer: a HuggingFace folder holding tokenizer.json, or a tokenizer.json file (its
    folder's other files count only where it is named tokenizer.json)."""
    path = Path(given)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise HethubError(
                f"--tokenizer = {given!r}: the folder holds no tokenizer.json (a HuggingFace "
                "folder with a fast tokenizer's tokenizer.json is needed)"
            )
        return TokenizerSource(given, path / "tokenizer.json", path)
    if path.is_file() and path.suffix == ".json":
        return TokenizerSource(given, path, path.parent if path.name == "tokenizer.json" else None)
    what = "no such file or folder" if not path.exists() else "not a tokenizer.json"
    raise HethubError(f"--tokenizer = {given!r}: {what}; give a HuggingFace folder or its file")


def _load_tokenizer(json_path: Path) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(json_path))
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises Exception itself
        raise HethubError(
            f"{json_path}: not a tokenizer the tokenizers library reads ({error})"
        ) from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _special_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


class Encoder:
    """Encodes chunks of documents: their ids one after another (EOS after each), and each
    one's length."""

    def __init__(self, json_path: Path, eos: int, dtype: str) -> None:
        self.tokenizer, self.eos, self.dtype = _load_tokenizer(json_path), eos, np.dtype(dtype)

    def __call__(self, chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
        texts = chunk.texts if chunk.texts is not None else _decode_lines(chunk)
        ids: list[int] = []
        lengths = []
        for encoding in self.tokenizer.encode_batch_fast([t for t in texts if t]):
            document = encoding.ids
            if not document or document[-1] != self.eos:
                document.append(self.eos)
            ids.extend(document)
            lengths.append(len(document))
        return np.array(ids, dtype=self.dtype), np.array(lengths, dtype=np.int32)


def _decode_lines(chunk: Chunk) -> list[str]:
    """A .jsonl chunk's documents: each non-empty line's ``chunk.field``."""
    field, texts = chunk.field, []
    for number, line in enumerate(chunk.lines or [], chunk.first_line):
        if not line.strip():
            continue
        where = f"{chunk.source}:{number}"
        try:
            record = json.loads(line)
        except ValueError as error:
            raise HethubError(f"{where}: not a JSON line ({error})") from None
        if not isinstance(record, dict) or field not in record:
            raise HethubError(f"{where}: no {field!r} field (choose it with --field)")
        if not isinstance(record[field], str):
            raise HethubError(f"{where}: {field!r} is {type(record[field]).__name__}, not text")
        texts.append(record[field])
    return texts


_WORKER: dict[str, Encoder] = {}
"""A worker process's encoder; the main process's where it encodes alone."""


def _start_worker(json_path: Path, eos: int, dtype: str) -> None:
    os.environ[PARALLELISM] = "false"  # one thread per process: the processes are the parallelism
    _WORKER["encoder"] = Encoder(json_path, eos, dtype)


def _encode(chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
    return _WORKER["encoder"](chunk)


def input_files(inputs: list[str]) -> list[Path]:
    """--input, expanded: each path a file, or a folder's files of the accepted kinds in name
    order; refused in one line where a path is missing, compressed or of an unknown kind."""
    files = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.is_file())
            packed = [p for p in inside if p.suffix.lower() in COMPRESSED_SUFFIXES]
            if packed:
                raise HethubError(
                    f"--input = {given!r}: holds compressed {packed[0].name}; decompress it first"
                )
            found = [p for p in inside if _kind(p) is not None]
            if not found:
                raise HethubError(f"--input = {given!r}: the folder holds none of {INPUT_FORMATS}")
            files.extend(found)
        elif path.is_file():
            if _kind(path) is None:
                raise HethubError(
                    f"--input = {given!r}: not a format hethub data prepare reads; it reads "
                    f"{INPUT_FORMATS} (decompress compressed files first)"
                )
            files.append(path)
        else:
            raise HethubError(f"--input = {given!r}: no such file or folder")
    for path in files:
        with open(path, "rb") as file:
            head = file.read(8)
        if any(head.startswith(magic) for magic in COMPRESSED):
            raise HethubError(f"--input = {str(path)!r}: compressed; decompress it first")
    return files


def _kind(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix)


def _chunks(files: list[Path], field: str) -> Iterator[Chunk]:
    """The inputs' documents in order, in chunks of about CHUNK_BYTES."""
    texts: list[str] = []
    size = 0
    for path in files:
        kind = _kind(path)
        if kind == "text":
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError as error:
                raise HethubError(f"{path}: not UTF-8 text (byte {error.start})") from None
            size += path.stat().st_size
            if size >= CHUNK_BYTES:
                yield Chunk(texts, None, field, str(path), 1, size)
                texts, size = [], 0
            continue
        if texts:  # keep input order: the text files before this file go first
            yield Chunk(texts, None, field, "", 1, size)
            texts, size = [], 0
        yield from (_jsonl_chunks if kind == "jsonl" else _parquet_chunks)(path, field)
    if texts:
        yield Chunk(texts, None, field, "", 1, size)


def _jsonl_chunks(path: Path, field: str) -> Iterator[Chunk]:
    lines: list[bytes] = []
    size, first = 0, 1
    with open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            lines.append(line)
            size += len(line)
            if size >= CHUNK_BYTES:
                yield Chunk(None, lines, field, str(path), first, size)
                lines, size, first = [], 0, number + 1
    if lines:
        yield Chunk(None, lines, field, str(path), first, size)


def _parquet_chunks(path: Path, field: str) -> Iterator[Chunk]:
    import pyarrow as pa  # only where a .parquet is given: a large import
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (OSError, ValueError, pa.ArrowException) as error:
        raise HethubError(f"{path}: not a readable parquet file ({error})") from None
    if field not in file.schema_arrow.names:
        raise HethubError(
            f"{path}: no column {field!r} (columns: {', '.join(file.schema_arrow.names)}; "
            "choose one with --field)"
        )
    rows, size = max(file.metadata.num_rows, 1), path.stat().st_size
    for batch in file.iter_batches(batch_size=4096, columns=[field]):
        texts = batch.column(0).to_pylist()
        if any(t is not None and not isinstance(t, str) for t in texts):
            raise HethubError(f"{path}: column {field!r} is not text")
        yield Chunk([t for t in texts if t], None, field, str(path), 1, size * len(texts) // rows)


def prepare(
    tokenizer: str,
    inputs: list[str],
    out: Path,
    *,
    field: str = "text",
    workers: int | None = None,
    eos: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> Prepared:
    """Tokenize ``inputs`` into ``out`` (see the module's doc). ``workers``: processes (default:
    the cores this process may run on; 1 encodes in this process, with the tokenizers library's
    own threads). ``progress(done_bytes, total_bytes, tokens)`` is called after each chunk."""
    source = tokenizer_source(tokenizer)
    files = input_files(inputs)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HethubError(f"--out = {str(out)!r}: exists and is not empty; choose a new folder")
    loaded = _load_tokenizer(source.json_path)
    config = source.config()
    eos_token = eos or _special_token(config, "eos_token")
    if eos_token is None:
        raise HethubError(
            f"--tokenizer = {tokenizer!r}: no eos_token in its tokenizer_config.json; name the "
            "token that ends a document with --eos"
        )
    eos_id = loaded.token_to_id(eos_token)
    if eos_id is None:
        raise HethubError(f"--eos = {eos_token!r}: not a token of the tokenizer")
    bos_token = _special_token(config, "bos_token")
    bos_id = loaded.token_to_id(bos_token) if bos_token else None
    vocab = max(loaded.get_vocab(with_added_tokens=True).values()) + 1
    dtype = token_dtype(vocab)
    workers = workers or (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        writer = IndexedWriter(out / "tokens", dtype)
        total = sum(p.stat().st_size for p in files)
        done = 0
        for (tokens, lengths), size in _encoded(
            _chunks(files, field), source.json_path, eos_id, dtype.str, workers
        ):
            writer.add_documents(tokens, lengths)
            done += size
            if progress:
                progress(done, total, writer.tokens)
        writer.finish()
        _copy_tokenizer(source, out / "tokenizer")
        metadata = {
            "tokenizer": tokenizer,
            "tokenizer_sha256": hashlib.sha256(source.json_path.read_bytes()).hexdigest(),
            "vocab": vocab,
            "eos": eos_id,
            "bos": bos_id,
            "documents": writer.documents,
            "tokens": writer.tokens,
            "dtype": str(dtype),
        }
        write_atomic(out / "metadata.json", json.dumps(metadata, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # it was empty or new: nothing of the user's
        raise
    return Prepared(out, writer.documents, writer.tokens, time.perf_counter() - started)


def _encoded(
    chunks: Iterator[Chunk], json_path: Path, eos: int, dtype: str, workers: int
) -> Iterator[tuple[tuple[np.ndarray, np.ndarray], int]]:
    """Each chunk's (tokens, lengths) and input bytes, in input order."""
    if workers == 1:
        encoder = Encoder(json_path, eos, dtype)
        for chunk in chunks:
            yield encoder(chunk), chunk.size
        return
    # Set while the workers start: the tokenizers library, forked after its threads ran here,
    # would otherwise warn once in each of them.
    before = os.environ.get(PARALLELISM)
    os.environ[PARALLELISM] = "false"
    try:
        pool = get_context().Pool(workers, _start_worker, (json_path, eos, dtype))
    finally:
        if before is None:
            del os.environ[PARALLELISM]
        else:
            os.environ[PARALLELISM] = before
    with pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append((pool.apply_async(_encode, (chunk,)), chunk.size))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                result, size = pending.popleft()
                yield result.get(), size
        while pending:
            result, size = pending.popleft()
            yield result.get(), size


def _copy_tokenizer(source: TokenizerSource, into: Path) -> None:
    into.mkdir()
    shutil.copyfile(source.json_path, into / "tokenizer.json")
    for name in TOKENIZER_FILES if source.folder else ():
        if (source.folder / name).is_file():
            shutil.copyfile(source.folder / name, into / name)
