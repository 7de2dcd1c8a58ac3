"""What ``--data`` (and ``--eval-data``) names, opened as a Corpus: a folder written by
``hethub data prepare``, a Megatron-LM PREFIX (PREFIX.bin + PREFIX.idx), nanoGPT's .bin of
uint16 tokens, a text file or a folder of them (bytes, vocabulary 256), the built-in corpus, or
a blend of several, ``W1:PATH1,W2:PATH2``.

Any other file is refused in one line, never read as bytes: a .jsonl or .parquet is raw text
for ``hethub data prepare``, a compressed file must be decompressed first, and the rest are not
corpora hethub knows.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from pathlib import Path

import numpy as np

from hethub.corpus.formats import (
    ACCEPTED,
    BUILTIN_NAME,
    COMPRESSED,
    PREPARED_FILES,
    TEXT_SEPARATOR,
    TEXT_SUFFIXES,
)
from hethub.corpus.indexed import read_index
from hethub.corpus.tokens import TokenPart, TokenStream
from hethub.corpus.windows import BLEND_BLOCK, BlendedCorpus, Corpus, TokenCorpus
from hethub.errors import HethubError

LOOKS_LIKE_BLEND = re.compile(r"^\s*[-+.\w]*\s*:|,")
"""A spec that is no path and has a WEIGHT: prefix or a comma is read as a blend."""


def builtin_text() -> bytes:
    """The standard library's pydoc topic texts (about 460 KB): a corpus with no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def open_corpus(spec: str | Path | None, *, what: str = "--data") -> Corpus:
    """The corpus ``spec`` names (None: the built-in one). ``what`` names the flag in errors.
    Opening reads headers only; nothing the size of the corpus is read."""
    if spec is None:
        stream = TokenStream([TokenPart.memory(np.frombuffer(builtin_text(), np.uint8))])
        return TokenCorpus(BUILTIN_NAME, stream, vocab=256, tokenizer="bytes")
    spec = str(spec)
    if not _names_data(Path(spec)) and LOOKS_LIKE_BLEND.search(spec):
        return _blend(spec, what)
    return _open_one(Path(spec), spec, f"{what} = {spec!r}")


def absolute_spec(spec: str, relative_to: Path) -> str:
    """``spec`` with its paths (each part's, in a blend) made absolute from ``relative_to``: what
    a run records, so that it resumes from anywhere."""
    if _names_data(relative_to / spec) or not LOOKS_LIKE_BLEND.search(spec):
        return str((relative_to / spec).resolve())
    return ",".join(
        f"{weight}:{(relative_to / path).resolve()}" for weight, path in _blend_parts(spec, "")
    )


def _names_data(path: Path) -> bool:
    return path.exists() or _megatron_prefix(path) is not None


def _megatron_prefix(path: Path) -> str | None:
    """The Megatron-LM prefix ``path`` names (PREFIX, PREFIX.bin or PREFIX.idx, both files
    present), else None."""
    text = str(path)
    for prefix in (text, text.removesuffix(".bin"), text.removesuffix(".idx")):
        if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
            return prefix
    return None


def _open_one(path: Path, name: str, label: str) -> TokenCorpus:
    if path.is_dir():
        if (path / "metadata.json").exists():
            return _prepared(path, name, label)
        return _text_folder(path, name, label)
    prefix = _megatron_prefix(path)
    if prefix is not None:
        return _megatron(prefix, name, label)
    if not path.exists():
        raise HethubError(f"{label}: no such file or folder")
    _refuse_compressed(path, label)
    if path.suffix == ".idx":
        raise HethubError(f"{label}: a Megatron-LM index without its {path.stem}.bin beside it")
    if path.suffix == ".bin":
        return _nanogpt(path, name, label)
    if path.suffix.lower() in TEXT_SUFFIXES or (not path.suffix and _looks_like_text(path)):
        return _bytes(name, [TokenPart.file(path, np.uint8)], label)
    raise HethubError(
        f"{label}: not a corpus hethub reads; {ACCEPTED}; for raw .jsonl or .parquet run "
        "`hethub data prepare` first"
    )


def _refuse_compressed(path: Path, label: str) -> None:
    with open(path, "rb") as file:
        head = file.read(8)
    for magic, kind in COMPRESSED.items():
        if head.startswith(magic):
            raise HethubError(f"{label}: {kind}-compressed; decompress it first ({ACCEPTED})")


def _looks_like_text(path: Path) -> bool:
    """Whether a file without a suffix starts as UTF-8 text does (no NUL in its first 4 KB)."""
    with open(path, "rb") as file:
        head = file.read(4096)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return b"\x00" not in head


def _bytes(name: str, parts: list[TokenPart], label: str) -> TokenCorpus:
    corpus = TokenCorpus(name, TokenStream(parts), vocab=256, tokenizer="bytes")
    if len(corpus) == 0:
        raise HethubError(f"{label}: empty, no tokens to train on")
    return corpus


def _text_folder(path: Path, name: str, label: str) -> TokenCorpus:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise HethubError(
            f"{label}: the folder holds no text files ({', '.join(TEXT_SUFFIXES)}) and is not "
            f"one `hethub data prepare` wrote (no metadata.json)"
        )
    separator = TokenPart.memory(np.frombuffer(TEXT_SEPARATOR, np.uint8))
    parts = [separator] * (2 * len(files) - 1)
    parts[::2] = [TokenPart.file(file, np.uint8) for file in files]
    return _bytes(name, parts, label)


def _nanogpt(path: Path, name: str, label: str) -> TokenCorpus:
    size = path.stat().st_size
    if size % 2:
        raise HethubError(f"{label}: {size} bytes, not whole uint16 tokens (nanoGPT's .bin)")
    corpus = TokenCorpus(name, TokenStream([TokenPart.file(path, np.uint16)]))
    if len(corpus) == 0:
        raise HethubError(f"{label}: empty, no tokens to train on")
    return corpus


def _megatron(prefix: str, name: str, label: str, **known: object) -> TokenCorpus:
    """A .bin + .idx pair. Its sequences are read as one stream, so the .bin must hold them
    one after another from its start, as Megatron's builder and hethub write them."""
    index = read_index(Path(f"{prefix}.idx"), label)
    bin_path = Path(f"{prefix}.bin")
    size, item = bin_path.stat().st_size, index.dtype.itemsize
    if size % item:
        raise HethubError(f"{label}: {bin_path.name} is {size} bytes, not whole {index.dtype}")
    if index.sequences:
        pointers, lengths = index.sequence_pointers(), index.sequence_lengths()
        first, end = int(pointers[0]), int(pointers[-1]) + int(lengths[-1]) * item
        del pointers, lengths
        if first != 0 or end != size:
            raise HethubError(
                f"{label}: its index says the tokens run from byte {first} to {end} of "
                f"{bin_path.name}, which has {size}: hethub reads sequences packed from the start"
            )
    corpus = TokenCorpus(name, TokenStream([TokenPart.file(bin_path, index.dtype)]), **known)
    if len(corpus) == 0:
        raise HethubError(f"{label}: empty, no tokens to train on")
    return corpus


def _prepared(path: Path, name: str, label: str) -> TokenCorpus:
    missing = [f for f in PREPARED_FILES if not (path / f).is_file()]
    if missing:
        raise HethubError(
            f"{label}: a prepared folder lacks {', '.join(missing)} (was `hethub data prepare` "
            "interrupted? run it again)"
        )
    try:
        metadata = json.loads((path / "metadata.json").read_text())
        vocab, dtype, sha = metadata["vocab"], metadata["dtype"], metadata["tokenizer_sha256"]
    except (ValueError, KeyError, TypeError) as error:
        raise HethubError(f"{label}: metadata.json is unreadable ({error})") from None
    tokenizer_dir = path / "tokenizer"
    corpus = _megatron(
        str(path / "tokens"),
        name,
        label,
        vocab=vocab,
        tokenizer=sha,
        tokenizer_dir=tokenizer_dir if tokenizer_dir.is_dir() else None,
    )
    if {str(t) for t in corpus.tokens.dtypes} != {dtype}:
        raise HethubError(f"{label}: metadata.json says {dtype}, tokens.idx says otherwise")
    return corpus


def _blend_parts(spec: str, label: str) -> list[tuple[float, str]]:
    rule = "a blend is W1:PATH1,W2:PATH2,... with positive weights"
    parts = []
    for item in spec.split(","):
        weight, colon, path = item.partition(":")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not colon or not path.strip() or not (math.isfinite(value) and value > 0):
            raise HethubError(f"{label}: {item.strip()!r}: {rule}")
        parts.append((value, path.strip()))
    return parts


def _blend(spec: str, what: str) -> BlendedCorpus:
    label = f"{what} = {spec!r}"
    given = _blend_parts(spec, label)
    total = sum(weight for weight, _ in given)
    parts = [
        (weight / total, _open_one(Path(path), path, f"{label}: {path!r}"))
        for weight, path in given
    ]
    for (share, corpus), (weight, _) in zip(parts, given):
        if share * BLEND_BLOCK < 0.5:
            raise HethubError(
                f"{label}: {corpus.name!r}'s weight {weight} is {share:.1e} of the blend, below "
                f"the 1/{BLEND_BLOCK} a blend deals"
            )
    kinds = {corpus.tokenizer for _, corpus in parts}
    if "bytes" in kinds and len(kinds) > 1:
        raise HethubError(f"{label}: blends text (bytes) with token files; the ids would clash")
    tokenizers = kinds - {None, "bytes"}
    if len(tokenizers) > 1:
        raise HethubError(
            f"{label}: its parts were prepared with different tokenizers "
            f"(SHA-256 {', '.join(sorted(t[:12] for t in tokenizers))}...)"
        )
    return BlendedCorpus(spec, parts)
