"""What a corpus's size costs a real training run (issue 37's targets): a 1.2 GB corpus trains
with the same per-process peak memory as an 80 KB one, within 300 MB, and reading a step's batch
adds under 1% to the step.

Both corpora are nanoGPT .bin files of uint16 byte tokens (local-llama's vocabulary of 256),
written to a temporary folder (--dir) and removed after. Each trains `hethub train --data FILE
--steps N` (the default run: local-llama planned on the built-in two-kind cluster) under a
wrapper process whose RUSAGE_CHILDREN maximum resident set is the largest peak of any process
of the run (hethub train, torchrun, each worker). The step time is the run's median
iteration_time_s (metrics.jsonl); the batch's time is Corpus.batch of the run's global batch and
sequence length from the large file, as every worker calls it once a step, timed here over
--reads batches at spread-out positions.

    python benchmarks/corpus_in_training.py [--gigabytes 1.2] [--steps 8] [--reads 200] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parent.parent / "src"
WRAPPER = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
if done.returncode:
    sys.exit(done.stderr[-2000:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def write_tokens(path: Path, tokens: int) -> None:
    """``tokens`` uint16 byte ids, written a chunk at a time."""
    chunk = (np.arange(1 << 24, dtype=np.int64) * 7919 % 251).astype(np.uint16)
    with open(path, "wb") as out:
        for start in range(0, tokens, len(chunk)):
            chunk[: min(len(chunk), tokens - start)].tofile(out)


def train(data: Path, run: Path, steps: int) -> tuple[float, float]:
    """The run's largest per-process peak (MB) and median step (s)."""
    command = [sys.executable, "-m", "hethub", "train", "--data", str(data)]
    command += ["--steps", str(steps), "--checkpoint-every", str(steps), "--run-dir", str(run)]
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, *command], capture_output=True, text=True, check=True
    )
    peak_mb = int(done.stdout.split()[-1]) / 1024
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return peak_mb, statistics.median(r["iteration_time_s"] for r in records[1:])


def batch_seconds(data: Path, run: Path, reads: int) -> tuple[float, int, int]:
    """Mean seconds of one Corpus.batch of the run's global batch, and its shape."""
    sys.path.insert(0, str(SRC))
    from hethub.corpus import open_corpus
    from hethub.spec import load_model, load_plan

    plan = load_plan(run / "plan.yaml")
    seq_len = load_model(plan.model, relative_to=run).seq_len
    corpus = open_corpus(str(data))
    windows = len(corpus) // seq_len
    spread = np.linspace(0, windows - plan.global_batch, reads).astype(int)
    started = time.perf_counter()
    for first in spread:
        corpus.batch(int(first), plan.global_batch, seq_len, seed=0)
    return (time.perf_counter() - started) / reads, plan.global_batch, seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=1.2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--dir", help="where the corpora are written (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        small, large = folder / "small.bin", folder / "large.bin"
        write_tokens(small, 40_000)  # 80 KB
        write_tokens(large, int(args.gigabytes * 1e9) // 2)
        rows = {}
        for name, data in (("80 KB", small), (f"{args.gigabytes:g} GB", large)):
            rows[name] = train(data, folder / f"run-{data.stem}", args.steps)
        read_s, batch, seq_len = batch_seconds(large, folder / "run-large", args.reads)
    print(f"hethub train, {args.steps} steps of the default run (local-llama, 2 ranks)")
    print(f"  {'corpus':<8} {'largest process peak':>21} {'median step':>12}")
    for name, (peak, step) in rows.items():
        print(f"  {name:<8} {peak:>18,.0f} MB {step:>10.3f} s")
    (small_peak, _), (large_peak, large_step) = rows.values()
    difference = large_peak - small_peak
    share = read_s / large_step
    print(f"peak difference: {difference:+,.0f} MB (target: within 300 MB)")
    print(
        f"a step's batch ({batch} x {seq_len + 1} tokens) from the large corpus: "
        f"{read_s * 1e3:.2f} ms, {100 * share:.3f}% of its median step (target: under 1%)"
    )
    met = abs(difference) <= 300 and share < 0.01
    print("targets met" if met else "targets NOT met")


if __name__ == "__main__":
    main()
