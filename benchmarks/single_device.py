"""hethub's one-rank step against a plain-torch trainer of the same model and recipe, on one
device (issue 26: hethub/reference >= 0.95x in bf16 and in fp32).

hethub: its Engine on a one-stage, one-rank plan (one micro-batch of the whole batch). The
reference, written here as a plain torch trainer would be: a Llama (RMSNorm, RoPE, SwiGLU,
grouped-query attention) through F.rms_norm, one GEMM for [q; k; v] and one for [gate; up] (as a
fused trainer writes them), F.scaled_dot_product_attention (causal, GQA) and F.cross_entropy,
with its rotary tables made once; AdamW fused where the device has the kernel,
else foreach; in bf16, bf16 weights with fp32 master weights and fp32 main gradients, as hethub's
recipe. It starts from hethub's initial weights (its full state dict), so both train the same
weights on the same batches: their first losses are printed side by side.

Both run in one process, one step each in turn (the order swapped every round) after warm-up
steps, so that both see the same moments of a shared machine; each figure is the median step.
It prints the throughput ratio, the non-view aten operations and the host reads of one step of
each (counted by OpCounter), and on an accelerator the model FLOP utilisation (the predictor's
model FLOPs over the catalog's peak, where the catalog knows the device) and the peak memory.

    python benchmarks/single_device.py [--precision bf16|fp32] [--steps N] [--device DEV]
        [--model PRESET|FILE|JSON] [--batch N]

--model: a Llama preset's name (tiny-llama, local-llama, llama-7b, ...), a model file's path or
a model spec in JSON (a model file's fields, docs/formats.md), instead of the default below.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from hethub.corpus import open_corpus
from hethub.errors import HethubError
from hethub.predictor import predict
from hethub.profiler.op_counts import OpCounter
from hethub.runtime.engine import Engine
from hethub.runtime.model import full_state, unfuse
from hethub.spec import load_model, parse_cluster, parse_model, parse_plan
from hethub.spec.accelerator import catalog
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import fused_parts
from hethub.spec.plan import Plan
from hethub.spec.topology import build_topology

MODEL = {  # local-llama's shape, with grouped-query attention (2 KV heads for 4 query heads)
    "arch": "llama",
    "hidden": 192,
    "layers": 8,
    "heads": 4,
    "kv_heads": 2,
    "ffn_hidden": 512,
    "vocab": 256,
    "seq_len": 128,
}
BATCH = 8  # sequences a step, one micro-batch (--batch)
LR, SEED = 1e-3, 0
WARMUP = 2  # steps of each before the timed ones (the first step's loss, the peak memory)

# --- the reference: a plain torch trainer -------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32 whatever x's dtype, then scaled in x's dtype, as hethub's
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return normed.to(x.dtype) * self.weight


def rotary_tables(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """cos and sin of every position's rotary angles (2, T, head_dim), made once."""
    d = spec.head_dim
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    angles = torch.outer(torch.arange(spec.seq_len, dtype=torch.float32, device=device), inv)
    return torch.stack([angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)]).to(dtype)


def rotate(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * tables[0] + half * tables[1]


class Layer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, d
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        self.split = [spec.heads * d, spec.kv_heads * d, spec.kv_heads * d]  # [q; k; v] rows
        self.qkv = nn.Linear(h, sum(self.split), bias=False)
        self.o = nn.Linear(spec.heads * d, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * spec.ffn_hidden, bias=False)  # [gate; up] rows
        self.down = nn.Linear(spec.ffn_hidden, h, bias=False)

    def forward(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.norm1(x)
        q, k, v = self.qkv(y).split(self.split, dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, d)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, d)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            rotate(q, tables), rotate(k, tables), v, is_causal=True, enable_gqa=True
        )
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))  # (B, T, h)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)  # (B, T, f) each
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    """The whole model, its parameters named as hethub's full state dict names them, its fused
    projections laid out as a plain fused trainer's (``plain_state``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(Layer(spec) for _ in range(spec.layers))
        self.final_norm = RMSNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, h)
        for layer in self.layers:
            x = layer(x, tables)
        return self.head(self.final_norm(x))  # (B, T, vocab)


def plain_state(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hethub's full state dict with each fused projection in a plain fused trainer's layout: the
    rows of its parts one after the other ([q; k; v], [gate; up]), not hethub's blocks."""
    plain = dict(state)
    for i in range(spec.layers):
        for name, parts in fused_parts(spec).items():
            key = f"layers.{i}.{name}"
            plain[key] = torch.cat(unfuse(parts, state[key]))
    return plain


class Reference:
    """A plain torch trainer of ``spec`` from hethub's initial weights: in bf16, bf16 weights
    computing, fp32 masters (and their fp32 gradients) stepped by AdamW and copied back."""

    def __init__(self, spec: ModelSpec, precision: str, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        with torch.device("meta"):
            model = Llama(spec)
        model.to_empty(device=device)
        model.load_state_dict(plain_state(spec, full_state(spec, SEED)))
        self.params = list(model.parameters())
        self.masters = self.params  # fp32: the weights are their own masters
        if self.dtype != torch.float32:  # the masters keep the fp32 initial values
            self.masters = [nn.Parameter(p.detach().clone()) for p in self.params]
        self.model = model.to(self.dtype)
        fused = device.type in _get_fused_kernels_supported_devices()  # torch's own list
        kernel = {"fused": True} if fused else {"foreach": True}
        self.optimizer = torch.optim.AdamW(self.masters, lr=LR, weight_decay=0.0, **kernel)
        self.tables = rotary_tables(spec, self.dtype, device)

    def step(self, tokens: torch.Tensor) -> float:
        if self.device.type != "cpu":  # as a DataLoader with pin_memory gives them
            tokens = tokens.pin_memory()
        tokens = tokens.to(self.device, non_blocking=True)
        logits = self.model(tokens[:, :-1], self.tables)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if self.masters is not self.params:
            for param, master in zip(self.params, self.masters, strict=True):
                master.grad, param.grad = param.grad.float(), None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return loss.item()  # the step's one read, as a trainer logging its loss makes


# --- hethub ------------------------------------------------------------------------------------


def hethub_plan(
    precision: str, accelerator: str, layers: int, batch: int = BATCH
) -> tuple[Plan, object]:
    """A one-rank plan of one stage of ``layers`` layers training ``batch`` sequences a step as
    one micro-batch, on one ``accelerator``; and its cluster."""
    plan = parse_plan(
        {
            "model": "bench",
            "precision": precision,
            "global_batch": batch,
            "micro_batch": batch,
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 1,
                    "stages": [{"group": "one", "tp": 1, "layers": layers}],
                }
            ],
        }
    )
    cluster = parse_cluster(
        {"groups": [{"name": "one", "accelerator": accelerator, "nodes": 1, "devices_per_node": 1}]}
    )
    return plan, cluster


def hethub_engine(spec: ModelSpec, plan: Plan, cluster, device: torch.device) -> Engine:
    return Engine.for_job(
        plan, build_topology(plan, cluster), spec, cluster, seed=SEED, lr=LR, device=device
    )


# --- measuring ----------------------------------------------------------------------------------


def counted(step, tokens: torch.Tensor, device: torch.device) -> OpCounter:
    """The operations of one step."""
    with OpCounter(device) as ops:
        step(tokens)
    return ops


def timed(step, tokens: torch.Tensor, device: torch.device) -> float:
    """Seconds of one step, the device's work included."""
    started = time.perf_counter()
    step(tokens)
    if device.type != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter() - started


def allocated(device: torch.device) -> int:
    """Bytes allocated on the device now (0 on the CPU, where nothing counts them)."""
    return torch.accelerator.memory_allocated() if device.type != "cpu" else 0


def warm_up(
    step, batches: list[torch.Tensor], device: torch.device, resident: int
) -> tuple[float, int | None]:
    """A trainer's first two steps: the first's loss, and on an accelerator the most memory the
    second held, less ``resident``, what was allocated before the trainer was built (None on
    the CPU)."""
    loss = step(batches[0])
    if device.type == "cpu":
        step(batches[1])
        return loss, None
    torch.accelerator.reset_peak_memory_stats()
    step(batches[1])
    return loss, torch.accelerator.max_memory_allocated() - resident


def accelerator_of(device: torch.device) -> str | None:
    """The catalog's name of the device (its peak FLOPs are the MFU's), or None."""
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()  # "nvidia h100 80gb hbm3", ...

    def matched(key: str) -> tuple[int, int]:  # its parts found in the name, then its length
        parts = key.split("-")
        return (sum(part in name for part in parts) if parts[0] in name else 0, len(key))

    best = max(catalog(), key=matched)
    return best if matched(best)[0] else None


def model_spec(text: str | None) -> ModelSpec:
    """The model to train: the default (MODEL), a preset's by name, a model file's by path, or
    a JSON model spec."""
    if text is None:
        return parse_model(MODEL, "bench", "bench")
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        spec = parse_model(data, "--model", data.get("name", "custom"))
    else:
        spec = load_model(text)
    if spec.arch != "llama":
        raise ValueError(f"--model {spec.name} is a {spec.arch}: the reference trainer is a Llama")
    return spec


def compare(
    precision: str, steps: int, device: torch.device, spec: ModelSpec, batch: int = BATCH
) -> None:
    accelerator = accelerator_of(device)
    plan, cluster = hethub_plan(precision, accelerator or "h100", spec.layers, batch)
    corpus = open_corpus(None)
    batches = [corpus.batch(s * batch, batch, spec.seq_len, SEED) for s in range(WARMUP + steps)]
    # Built one after the other, each warmed up before the next exists: the two first losses
    # (the same weights, the same batch) agree, and each one's peak memory is its own.
    builders = {
        "hethub": lambda: hethub_engine(spec, plan, cluster, device).step,
        "reference": lambda: Reference(spec, precision, device).step,
    }
    trainers, first, peak = {}, {}, {}
    for name, build in builders.items():
        resident = allocated(device)
        trainers[name] = build()
        first[name], peak[name] = warm_up(trainers[name], batches, device, resident)
    times = {name: [] for name in trainers}
    for s, tokens in enumerate(batches[WARMUP:]):
        for name in list(trainers) if s % 2 == 0 else list(reversed(trainers)):
            times[name].append(timed(trainers[name], tokens, device))
    ops = {name: counted(step, batches[-1], device) for name, step in trainers.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    tokens_per_step = batch * spec.seq_len
    print(
        f"{precision}: first loss hethub {first['hethub']:.6f}, reference {first['reference']:.6f}"
    )
    for name in trainers:
        line = (
            f"{precision} {name:9}: {median[name] * 1e3:7.1f} ms/step, "
            f"{tokens_per_step / median[name]:9,.0f} tokens/s, "
            f"{ops[name].total} ops (non-view) and {len(ops[name].host_reads)} host reads "
            f"a step"
        )
        if peak[name] is not None:
            line += f", peak memory {peak[name] / 2**30:.2f} GiB"
            if accelerator is not None:
                line += f", MFU {100 * mfu(plan, cluster, spec, median[name]):.1f}%"
        print(line)
    ratio = median["reference"] / median["hethub"]
    print(
        f"{precision} hethub/reference throughput: {ratio:.3f}x (target >= 0.95): "
        f"{'met' if ratio >= 0.95 else 'MISSED'}  [median of {len(times['hethub'])} steps each, "
        f"alternating, after {WARMUP} warm-up]",
        flush=True,
    )


def mfu(plan: Plan, cluster, spec: ModelSpec, seconds: float) -> float:
    """Model FLOP utilisation of a step of ``seconds``: the predictor's model FLOPs a step
    over the catalog's peak of the device in the plan's precision."""
    prediction = predict(plan, cluster, spec)
    flops = prediction.model_tflops_per_device * 1e12 * prediction.iteration_time_s
    group = cluster.group("one").accelerator
    peak = group.bf16_tflops if plan.precision.value == "bf16" else group.fp32_tflops
    return flops / seconds / (peak * 1e12) if peak else math.nan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--precision", choices=("bf16", "fp32"), help="one precision (default: both)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each (default 10)")
    parser.add_argument(
        "--device", help="torch device (default: the accelerator where there is one, else cpu)"
    )
    parser.add_argument(
        "--model", help="a Llama preset, model file or JSON model spec (default: the one above)"
    )
    parser.add_argument(
        "--batch", type=int, default=BATCH, help=f"sequences a step (default {BATCH})"
    )
    args = parser.parse_args(argv)
    try:
        spec = model_spec(args.model)
    except (ValueError, HethubError) as error:
        parser.error(str(error))
    default = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = torch.device(args.device or default or "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a run's worker does; the machine is shared
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print(
        f"model: llama hidden {spec.hidden}, {spec.layers} layers, "
        f"{spec.heads} heads ({spec.kv_heads} KV), seq {spec.seq_len}, "
        f"batch {args.batch}; device {device} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)",
        flush=True,
    )
    for precision in [args.precision] if args.precision else ["bf16", "fp32"]:
        compare(precision, args.steps, device, spec, args.batch)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
