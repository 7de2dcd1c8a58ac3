"""hethub's one-rank step with its layers compiled (a plan's ``compile: true``) against the same
step eager, in bf16 and in fp32: whether compile should be on by default on this device.

The model is local-llama, the model of `hethub train` with no arguments, one stage on one rank,
one micro-batch of BATCH sequences. Both engines start from the same seeded weights and train on
the same batches, so their first losses agree to the precision's rounding (printed side by side).
The compiled one's first step compiles (its time is printed: what a run pays once); then both
run in one process, one step each in turn (the order swapped every round), so that both see the
same moments of a shared machine; each figure is the median step.

    python benchmarks/compile_speed.py [--precision bf16|fp32] [--steps N] [--device DEV]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from hethub.corpus import open_corpus
from hethub.runtime.compiled import compiled_graphs, compiled_layers
from hethub.runtime.engine import Engine
from hethub.spec import load_model, parse_cluster, parse_plan
from hethub.spec.topology import build_topology

MODEL = "local-llama"
BATCH = 8  # sequences a step, one micro-batch
LR, SEED = 1e-3, 0
NAMES = ("eager", "compiled")
WARMUP = 2  # steps of each before the timed ones: the compiled one's first compiles


def engine(precision: str, compiled: bool, device: torch.device) -> Engine:
    spec = load_model(MODEL)
    plan = parse_plan(
        {
            "model": MODEL,
            "precision": precision,
            "compile": compiled,
            "global_batch": BATCH,
            "micro_batch": BATCH,
            "pipelines": [{"stages": [{"group": "one", "tp": 1, "layers": spec.layers}]}],
        }
    )
    # The accelerator only names the group: one rank, nothing priced.
    cluster = parse_cluster(
        {"groups": [{"name": "one", "accelerator": "cpu", "nodes": 1, "devices_per_node": 1}]}
    )
    return Engine.for_job(
        plan, build_topology(plan, cluster), spec, cluster, seed=SEED, lr=LR, device=device
    )


def timed(step, tokens: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """Seconds of one step, the device's work included, and its loss."""
    started = time.perf_counter()
    loss = step(tokens)
    if device.type != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter() - started, loss


def compare(precision: str, steps: int, device: torch.device) -> None:
    spec = load_model(MODEL)
    corpus = open_corpus(None)
    batches = [corpus.batch(s * BATCH, BATCH, spec.seq_len, SEED) for s in range(WARMUP + steps)]
    engines = {name: engine(precision, name == "compiled", device) for name in NAMES}
    first, warm_up = {}, {}
    graphs_before = compiled_graphs()
    for name, trainer in engines.items():
        seconds, first[name] = timed(trainer.step, batches[0], device)
        warm_up[name] = [seconds] + [timed(trainer.step, b, device)[0] for b in batches[1:WARMUP]]
    graphs = compiled_graphs() - graphs_before
    layers = compiled_layers(engines["compiled"].stage)
    times = {name: [] for name in engines}
    for s, tokens in enumerate(batches[WARMUP:]):
        for name in list(engines) if s % 2 == 0 else list(reversed(engines)):
            times[name].append(timed(engines[name].step, tokens, device)[0])
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{precision}: first loss eager {first['eager']:.6f}, compiled {first['compiled']:.6f}; "
        f"{layers} layers compiled into {graphs} graph(s), the first step "
        f"{warm_up['compiled'][0]:.1f} s (eager's {warm_up['eager'][0]:.2f} s)"
    )
    for name in engines:
        print(
            f"{precision} {name:8}: {median[name] * 1e3:7.1f} ms/step, "
            f"{BATCH * spec.seq_len / median[name]:9,.0f} tokens/s"
        )
    print(
        f"{precision} compiled/eager throughput: {median['eager'] / median['compiled']:.3f}x  "
        f"[median of {steps} steps each, alternating, after {WARMUP} warm-up]",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--precision", choices=("bf16", "fp32"), help="one precision (default: both)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each (default 10)")
    parser.add_argument(
        "--device", help="torch device (default: the accelerator where there is one, else cpu)"
    )
    args = parser.parse_args(argv)
    default = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = torch.device(args.device or default or "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a run's worker does; the machine is shared
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print(
        f"model: {MODEL}, batch {BATCH}; device {device} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)",
        flush=True,
    )
    for precision in [args.precision] if args.precision else ["bf16", "fp32"]:
        compare(precision, args.steps, device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
