"""Peak host memory of `hethub train --init-from`'s load (runtime.hf_checkpoint.load_hf_weights)
of a model of >= 1B parameters across 4 ranks (2 pipeline stages x TP 2): each rank reads only
its own slices, so its peak while loading is what it holds once loaded (its share of the job:
its weights, their gradients' buffer and the zero AdamW moments the load installs) plus the
largest single tensor, never the whole model.

The model (a Llama of 1.07B parameters: hidden 2048, 20 layers, GQA 16/8, vocabulary 32000) is
made here with random bf16 weights and written as safetensors shards with their index, one shard
at a time. Each rank builds its engine (fp32), resets its peak (/proc/self/clear_refs: 5), loads,
and reads the kernel's VmHWM (the most resident memory the process had at once) and VmRSS.

Usage: python benchmarks/hf_load_memory.py [--small] [--folder DIR]
Target (issue 37): each rank's peak while loading <= (what it holds once loaded + the largest
tensor) x 1.1.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from hethub.spec import parse_cluster, parse_model, parse_plan
from hethub.spec.hf_config import hf_config_from_model
from hethub.spec.hf_names import hf_tensors

BILLION = {
    "arch": "llama",
    "hidden": 2048,
    "layers": 20,
    "heads": 16,
    "kv_heads": 8,
    "ffn_hidden": 5632,
    "vocab": 32000,
    "seq_len": 128,
    "max_position_embeddings": 128,
}
SMALL = {**BILLION, "hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "ffn_hidden": 704}
SHARD_BYTES = 10**9
CLUSTER = {"groups": [{"name": "cpu", "accelerator": "cpu", "nodes": 1, "devices_per_node": 4}]}
MiB = 2**20


def write_model(model: dict, folder: Path) -> tuple[int, int]:
    """The HF folder of ``model`` with random bf16 weights (norms ones), written a shard at a
    time; its parameter count and its largest tensor's elements."""
    spec = parse_model(model, "benchmark", "billion")
    (folder / "config.json").write_text(json.dumps(hf_config_from_model(spec)))
    shapes = hf_tensors(spec)
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    for name, shape in shapes.items():
        if sum(math.prod(s) * 2 for s in shards[-1].values()) + math.prod(shape) * 2 > SHARD_BYTES:
            shards.append({})
        shards[-1][name] = shape
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {
            name: torch.ones(shape, dtype=torch.bfloat16)
            if len(shape) == 1
            else (torch.randn(shape) * 0.02).to(torch.bfloat16)
            for name, shape in shard.items()
        }
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(math.prod(s) for s in shapes.values()), max(math.prod(s) for s in shapes.values())


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    status = Path("/proc/self/status").read_text().splitlines()
    line = next(x for x in status if x.startswith(field))
    return int(line.split()[1]) * 1024


def _rank(rank: int, world: int, model: dict, folder: str) -> dict:
    from hethub.runtime.engine import Engine
    from hethub.runtime.hf_checkpoint import load_hf_weights
    from hethub.spec.topology import build_topology

    spec = parse_model(model, "benchmark", "billion")
    plan = parse_plan(
        {
            "model": "billion",
            "micro_batch": 1,
            "global_batch": 1,
            "precision": "fp32",
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 1,
                    "stages": [
                        {"group": "cpu", "tp": 2, "layers": spec.layers // 2},
                        {"group": "cpu", "tp": 2, "layers": spec.layers // 2},
                    ],
                }
            ],
        }
    )
    cluster = parse_cluster(CLUSTER, "benchmark")
    engine = Engine.for_job(plan, build_topology(plan, cluster), spec, cluster, seed=0)
    share = sum(p.numel() for _, p in engine.weights.named) * 4
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from here
    load_hf_weights(engine, Path(folder))
    return {
        "rank": rank,
        "weights": share,
        "before": before,
        "peak": _status("VmHWM"),
        "after": _status("VmRSS"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 30M model: a quick check")
    parser.add_argument("--folder", help="where to write the model (default: a temporary one)")
    args = parser.parse_args()
    model = SMALL if args.small else BILLION
    from hethub.runtime.spawn import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        params, largest = write_model(model, folder)
        largest_bytes = largest * 4  # read into fp32
        print(
            f"model: {params / 1e9:.3f}B parameters, {params * 2 / 2**30:.2f} GiB in bf16 on "
            f"file, {params * 4 / 2**30:.2f} GiB in fp32; largest tensor {largest_bytes / MiB:.0f}"
            " MiB in fp32; 4 ranks, 2 stages x TP 2"
        )
        ranks = run_ranks(_rank, 4, model, str(folder), timeout_s=1800, purpose="benchmark")
    print(
        "rank  weights MiB  RSS before MiB  RSS after MiB  peak MiB  "
        "peak - after MiB  target MiB  ok"
    )
    for r in ranks:
        target = (r["after"] + largest_bytes) * 1.1
        print(
            f"{r['rank']:>4}  {r['weights'] / MiB:>11.0f}  {r['before'] / MiB:>14.0f}  "
            f"{r['after'] / MiB:>13.0f}  {r['peak'] / MiB:>8.0f}  "
            f"{(r['peak'] - r['after']) / MiB:>16.0f}  {target / MiB:>10.0f}  "
            f"{'yes' if r['peak'] <= target else 'NO'}"
        )


if __name__ == "__main__":
    main()
