"""A process reading a memory-mapped corpus does not grow with the corpus (issue 37's target: a
1.2 GB corpus trains with the same per-process peak as an 80 KB one, within 300 MB).

The reading path of a training process, in a fresh process per corpus: import torch and
hethub.corpus, open_corpus, check (the model's vocabulary below the files' uint16 range, so
every token is scanned), then --steps global batches of --batch windows of --seq-len + 1 tokens
from the seeded, shuffled stream. The peak is the kernel's VmHWM (/proc/self/status): the most
resident memory the process ever had, the file pages it mapped included. The corpora are
nanoGPT .bin files of uint16 tokens (the 80 KB one and one of --gigabytes), written to a
temporary folder (--dir) and removed after. Each figure is one run; the time per batch is what
reading adds to a training step.

Before issue 37, runtime/data.load_tokens read the whole file and widened it to int64: the issue
measured 3.2 GB of peak for a 600 MB file against 354 MB for an 80 KB one.

    python benchmarks/corpus_memory.py [--gigabytes 1.2] [--steps 2000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parent.parent / "src"
VOCAB = 50_304  # GPT-2's, padded: below uint16's 65,536, so check reads every token
READER = """
import json, sys, time
sys.path.insert(0, {src!r})
import torch
from hethub.corpus import open_corpus

def peak_mb():
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM"))
    return int(line.split()[1]) / 1024

imported = peak_mb()
corpus = open_corpus({path!r})
started = time.perf_counter()
corpus.check({vocab}, {seq_len}, {batch})
checked_s = time.perf_counter() - started
started = time.perf_counter()
total = 0
for step in range({steps}):
    total += int(corpus.batch(step * {batch}, {batch}, {seq_len}, seed=0)[:, -1].sum())
batch_s = (time.perf_counter() - started) / {steps}
print(json.dumps(dict(tokens=len(corpus), imported_mb=imported, peak_mb=peak_mb(),
                      check_s=checked_s, batch_ms=batch_s * 1e3)))
"""


def write_tokens(path: Path, tokens: int) -> None:
    """``tokens`` uint16 ids below VOCAB, written a chunk at a time (never held whole here)."""
    chunk = np.arange(1 << 24, dtype=np.int64) % (VOCAB - 7)
    pieces = range(0, tokens, len(chunk))
    with open(path, "wb") as out:
        out.writelines(chunk[: tokens - first].astype(np.uint16).tobytes() for first in pieces)


def measure(path: Path, args: argparse.Namespace) -> dict:
    code = READER.format(
        src=str(SRC),
        path=str(path),
        vocab=VOCAB,
        seq_len=args.seq_len,
        batch=args.batch,
        steps=args.steps,
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=3600
    )
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32, help="windows a global batch")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=None, help="where the corpora are written")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        small, large = Path(tmp) / "small.bin", Path(tmp) / "large.bin"
        write_tokens(small, 40_000)  # 80 KB
        write_tokens(large, int(args.gigabytes * 1e9) // 2)
        rows = {name: measure(path, args) for name, path in (("80 KB", small), ("large", large))}
    print(
        f"{args.steps} batches of {args.batch} x {args.seq_len + 1} tokens each, after "
        f"open_corpus and check (vocabulary {VOCAB}: every token scanned)"
    )
    print(
        f"{'corpus':>8} {'tokens':>14} {'peak RSS':>10} {'of it imports':>14} {'check':>8} "
        f"{'a batch':>9}"
    )
    for name, row in rows.items():
        label = name if name != "large" else f"{args.gigabytes:g} GB"
        print(
            f"{label:>8} {row['tokens']:>14,} {row['peak_mb']:>7.0f} MB {row['imported_mb']:>11.0f}"
            f" MB {row['check_s']:>6.2f} s {row['batch_ms']:>6.2f} ms"
        )
    difference = rows["large"]["peak_mb"] - rows["80 KB"]["peak_mb"]
    print(f"peak difference: {difference:+.0f} MB (target: within 300 MB)")


if __name__ == "__main__":
    main()
