"""`hethub data prepare`'s tokens/s against the tokenizers library's own batch encoding on the
same cores (issue 37's target: at least 0.8x).

The corpus is the pydoc topic texts, one document per paragraph, repeated to --megabytes and
written as a .jsonl; the tokenizer a byte-level BPE of --vocab tokens trained on them (nothing
is downloaded). The library's figure is ``Tokenizer.encode_batch`` over the documents already
in memory, with its own threads on every core this process may use: its best case, with no
reading, no JSON and no writing. hethub's is the whole command's wall time, from the .jsonl on
disk to the folder written, with --workers processes (default: the same cores). Each is the best
of --repeats runs.

    python benchmarks/prepare_speed.py [--megabytes 32] [--vocab 8192] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from hethub.corpus.prepare import prepare

EOS = "<|endoftext|>"


def documents(megabytes: float) -> list[str]:
    paragraphs = [p for key in sorted(topics) for p in topics[key].split("\n\n") if p.strip()]
    docs, size, round_ = [], 0, 0
    while size < megabytes * 1e6:
        for paragraph in paragraphs:  # each round a little different, so no cache helps
            docs.append(f"{round_} {paragraph}")
            size += len(docs[-1])
        round_ += 1
    return docs


def train_tokenizer(folder: Path, vocab: int, docs: list[str]) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs[:20_000], trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=32.0)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    docs = documents(args.megabytes)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer_dir = train_tokenizer(root / "tok", args.vocab, docs)
        with open(root / "corpus.jsonl", "w") as out:
            out.writelines(json.dumps({"text": d}) + "\n" for d in docs)

        library = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        library_s, tokens = float("inf"), 0
        for _ in range(args.repeats):
            started = time.perf_counter()
            encodings = library.encode_batch(docs)
            library_s = min(library_s, time.perf_counter() - started)
            tokens = sum(len(e.ids) for e in encodings)
            del encodings

        hethub_s, prepared = float("inf"), None
        for _ in range(args.repeats):
            shutil.rmtree(root / "out", ignore_errors=True)
            started = time.perf_counter()
            prepared = prepare(
                str(tokenizer_dir), [str(root / "corpus.jsonl")], root / "out", workers=args.workers
            )
            hethub_s = min(hethub_s, time.perf_counter() - started)
    assert prepared.tokens == tokens + len(docs)  # the library's tokens and one EOS a document
    library_rate, hethub_rate = tokens / library_s, prepared.tokens / hethub_s
    print(
        f"{len(docs):,} documents, {args.megabytes:g} MB of text, BPE of {args.vocab} tokens, "
        f"{cores} cores"
    )
    print(f"tokenizers encode_batch (in memory): {tokens:>12,} tokens  {library_rate:>12,.0f} /s")
    print(
        f"hethub data prepare (.jsonl to disk): {prepared.tokens:>11,} tokens  "
        f"{hethub_rate:>12,.0f} /s  ({args.workers or cores} workers)"
    )
    print(f"ratio: {hethub_rate / library_rate:.2f}x (target: at least 0.8x)")


if __name__ == "__main__":
    main()
