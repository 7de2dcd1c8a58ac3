"""Measure what the runtime executes: its own stage modules (hethub.runtime.model) forward and
backward, in fp32 or bf16, on this machine's CPU or its GPU, and gloo messages and collectives
between local processes.

bf16 is the Megatron-LM recipe: the stage's weights and activations in bf16, the loss in fp32, and
AdamW on fp32 master weights (the optimizer time is the gradients copied into the fp32 masters,
the fp32 AdamW step, and the masters copied back into the bf16 weights). A GPU (the accelerator a
profile is named for, when it is an NVIDIA or AMD one: CUDA or ROCm) is measured in this process,
one TP rank alone, its passes timed by device events read after the last one (no synchronize
between a forward and its backward, as in a step); its links are not measured (they are not
gloo's between CPU processes).

Every time is the plain mean of several repeats after a warm-up, the occasional stall included,
as a run meets it. Each measuring process is bound to its share of the cores, as the runtime
binds a run's ranks (runtime.affinity), and runs in a session of its own (profile.spawn). A TP
degree above 1 is measured in a real gloo group of that many processes, so the layer's
collectives are inside its time. ``concurrent_ranks`` processes measure at once
(4 ranks on a 2-core machine share its cores, and so do their measurements): they start each
measurement together and then repeat it back to back, as the runtime runs its operations.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from hethub.comm import local_device
from hethub.errors import HethubError
from hethub.profiles.machine import cpu_model, host_name, load_average
from hethub.profiles.store import (
    COLLECTIVES,
    MEASURED_TIMES,
    METHOD,
    LayerKey,
    LayerProfile,
    LinkProfile,
    MeasuredOn,
    Profiles,
    empty_profiles,
    load_profiles,
    save_profile,
)
from hethub.report.text import plural
from hethub.runtime.model import Stage
from hethub.runtime.optimizer import PlainAdamW
from hethub.runtime.precision import COMPUTE_DTYPE, MasterWeights
from hethub.runtime.process_groups import GroupSpec, Role, blocks, create_groups
from hethub.runtime.rundir import DEFAULT_SETTINGS
from hethub.runtime.spawn import run_ranks
from hethub.runtime.timeline import DeviceClock, HostClock, step_clock
from hethub.spec.accelerator import catalog
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Recompute

DTYPES = {precision.value: dtype for precision, dtype in COMPUTE_DTYPE.items()}
"""The dtypes a layer is measured in (a profile's key names them)."""
DTYPE = "fp32"
"""What a caller that names no dtype gets: what the runtime trains in today."""
REPEATS, WARMUP = (
    30,
    2,
)  # short profiles are noisy: 8 passes of 2 layers varied by ~20% from one to the next
LAYERS_TIMED = 8
"""Layers chained in one timed forward (per-layer time = its time / layers): the runtime's stages
run several layers back to back, whose weights do not all stay in cache. Measured here with the
local model (1.8 MB of weights a layer, 4 MB of L2 a core): 8 chained layers took 2-11% longer
each than 4, and a run's 8-layer stage matched the 8-layer profile within 1%."""
LINK_SIZES = tuple(kib << 10 for kib in (4, 16, 64, 256, 512, 1024, 2048, 4096, 16384))
"""Message sizes measured (bytes): denser where a small model's gradient tensors are."""
LINK_REPEATS = 15
SMALL_MESSAGE = 1 << 20  # below it a message costs little to repeat, and its latency is noisy


# --- where ---------------------------------------------------------------------------------------


def measuring_device(device_name: str) -> torch.device:
    """Where profiles named ``device_name`` are measured on this machine: its CUDA (or ROCm) GPU
    when the name is a catalog accelerator of NVIDIA (AMD), else its CPU (``cpu``, an inline CPU
    accelerator's name, an emulated group's label). An accelerator this machine lacks, or one of
    a vendor the profiler cannot drive, is an error in one line."""
    known = catalog().get(device_name.strip().lower())
    vendor = known.vendor if known is not None else "cpu"
    if vendor == "cpu":
        return torch.device("cpu")
    kind = _VENDOR_PHRASE.get(vendor, f"a {vendor}")
    if vendor not in ("nvidia", "amd"):
        raise HethubError(
            f"--device = {device_name!r}: {kind} accelerator; hethub profile measures this "
            f"machine's CPU or its NVIDIA/AMD GPU (CUDA or ROCm)"
        )
    device = local_device(vendor)
    if device.type == "cpu":
        api = "ROCm" if vendor == "amd" else "CUDA"
        raise HethubError(
            f"--device = {device_name!r}: {kind} accelerator, and this machine has no {api} "
            f"GPU to measure it on (torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}); profile it on a machine that has one"
        )
    return device


_VENDOR_PHRASE = {
    "nvidia": "an NVIDIA",
    "amd": "an AMD",
    "intel": "an Intel",
    "huawei": "a Huawei",
    "other": "an other vendor's",
}


def describe_device(device: torch.device) -> str:
    """'CPU', or 'GPU (NVIDIA H200)'."""
    if device.type == "cpu":
        return "CPU"
    return f"GPU ({torch.cuda.get_device_name(device)})"


# --- layers ------------------------------------------------------------------------------------


def check_layer_request(
    model: ModelSpec,
    tps: Sequence[int],
    micro_batches: Sequence[int],
    *,
    threads: int = 1,
    concurrent_ranks: int = 1,
    dtype: str = DTYPE,
    device: torch.device | None = None,
) -> None:
    """Refuse, in one line, what cannot be measured: non-positive values, a TP degree that does
    not divide the heads, KV heads, FFN width and vocabulary, a concurrency not a multiple of tp,
    an unknown dtype, and on a GPU (``device``) more than one rank."""
    if dtype not in DTYPES:
        raise HethubError(f"--dtype = {dtype!r}: must be one of {', '.join(DTYPES)}")
    for name, values in (
        ("tp", tps),
        ("micro-batch", micro_batches),
        ("threads", [threads]),
        ("concurrent-ranks", [concurrent_ranks]),
    ):
        if not values or any(
            isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values
        ):
            raise HethubError(
                f"--{name} = {','.join(map(str, values)) or 'nothing'}: must be positive integers"
            )
    for tp in tps:
        for what, size in (
            ("heads", model.heads),
            ("kv_heads", model.kv_heads),
            ("ffn_hidden", model.ffn_hidden),
            ("vocab", model.vocab),
        ):
            if size % tp:
                raise HethubError(f"--tp = {tp}: must divide the model's {what} ({size})")
        if max(concurrent_ranks, tp) % tp:
            raise HethubError(
                f"--concurrent-ranks = {concurrent_ranks}: must be a multiple of --tp {tp} "
                f"(the ranks computing at once form whole TP groups)"
            )
    if device is not None and device.type != "cpu" and max(concurrent_ranks, *tps) > 1:
        raise HethubError(
            f"--tp = {','.join(map(str, tps))}, --concurrent-ranks = {concurrent_ranks}: on a GPU "
            f"the profiler measures one rank alone (give --tp 1 --concurrent-ranks 1)"
        )


def measure_layers(
    model: ModelSpec,
    device_name: str,
    tps: Sequence[int],
    micro_batches: Sequence[int],
    *,
    threads: int = 1,
    concurrent_ranks: int = 1,
    repeats: int = REPEATS,
    timeout_s: float = 600.0,
    dtype: str = DTYPE,
    where: torch.device | None = None,
) -> list[LayerProfile]:
    """Per-layer, embedding, head and optimizer costs of ``model`` in ``dtype`` on this machine
    (its GPU when ``device_name`` is an NVIDIA or AMD accelerator, else its CPU:
    measuring_device; ``where`` overrides it: a cluster's node measures where the runtime would
    run its group), one profile per (tp, micro-batch), keyed for ``device_name``.

    ``max(concurrent_ranks, tp)`` processes measure at once, in TP groups of tp; one process
    alone measures in this process (no start-up cost), as a GPU always is.
    """
    where = where or measuring_device(device_name)
    check_layer_request(
        model,
        tps,
        micro_batches,
        threads=threads,
        concurrent_ranks=concurrent_ranks,
        dtype=dtype,
        device=where,
    )
    stamp, load_before = _now(), load_average()
    measured: list[tuple[LayerKey, dict[str, float]]] = []
    for tp in dict.fromkeys(tps):
        world = max(concurrent_ranks, tp)
        args = (model, tp, tuple(micro_batches), repeats, dtype, str(where))
        if world == 1:
            try:
                per_rank = [_in_this_process(_measure_rank, threads, *args)]
            except RuntimeError as error:
                if dtype == "fp32":
                    raise
                # In one line: the runtime's modules refusing a dtype is not the user's input,
                # but the measurement cannot go on (e.g. a layer mixing bf16 and fp32 tensors).
                raise HethubError(
                    f"measuring {model.name} in {dtype} on the {describe_device(where)}: the "
                    f"runtime's {model.arch} modules failed: {_first_line(error)}"
                ) from None
        else:
            per_rank = run_ranks(_measure_rank, world, *args, threads=threads, timeout_s=timeout_s)
        for b in micro_batches:
            mean = {
                name: statistics.fmean(rank[b][name] for rank in per_rank)
                for name in per_rank[0][b]
            }
            key = LayerKey.of(
                model,
                device=device_name,
                dtype=dtype,
                threads=threads,
                concurrent_ranks=world,
                tp=tp,
                micro_batch=b,
            )
            measured.append((key, mean))
    where_and_load = measured_here(where, load_before)  # the load as the last pass ended
    return [
        LayerProfile(
            key=key,
            **{name: mean[name] for name in MEASURED_TIMES},
            layer_time_spread=mean["layer_time_spread"],
            layer_time_cv=mean["layer_time_cv"],
            layer_activation_bytes=int(mean["layer_activation_bytes"]),
            layer_param_bytes=int(mean["layer_param_bytes"]),
            measured_at=stamp,
            cores=available_cores(),
            measured_on=where_and_load,
        )
        for key, mean in measured
    ]


def measured_here(where: torch.device, load_before: float | None) -> MeasuredOn:
    """This machine, its torch, and the load average at a measurement's start (``load_before``)
    and now, its end: where a profile measured on ``where`` came from."""
    builds = (("cuda", torch.version.cuda), ("hip", getattr(torch.version, "hip", None)))
    return MeasuredOn(
        host=host_name(),
        cpu=cpu_model(),
        gpu=torch.cuda.get_device_name(where) if where.type == "cuda" else None,
        torch=torch.__version__,
        torch_build=next((f"{name} {version}" for name, version in builds if version), "cpu"),
        load_before=load_before,
        load_after=load_average(),
    )


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def available_cores() -> int:
    """CPU cores this process (and the measuring processes it starts) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _in_this_process(fn: Callable, threads: int, *args):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(0, 1, *args)
    finally:
        torch.set_num_threads(previous)


def _block_group(world: int, size: int, role: Role):
    """Collective: the groups of consecutive blocks of ``size`` ranks (process_groups.blocks);
    this rank's, or None when it is in none or alone in its block."""
    specs = [GroupSpec(role, ranks, "gloo") for ranks in blocks(world, size)]
    return next((group.handle for group in create_groups(specs).values()), None)


def _measure_rank(
    rank: int,
    world: int,
    model: ModelSpec,
    tp: int,
    micro_batches: tuple[int, ...],
    repeats: int,
    dtype: str = DTYPE,
    where: str = "cpu",
) -> dict[int, dict[str, float]]:
    """On one rank: the mean costs of each micro-batch size (all ranks measure at once), with the
    stage's weights and activations in ``dtype`` on device ``where``."""
    device, floating = torch.device(where), DTYPES[dtype]
    group = _block_group(world, tp, Role.TENSOR) if world > 1 else None
    together = _Together(group) if world > 1 else _Alone()
    clock = step_clock(device)
    timed = min(model.layers, LAYERS_TIMED)
    spec = dataclasses.replace(model, layers=timed)
    layers, embed, head = (
        Stage.build(spec, 0, count, group, is_first=first, is_last=last, seed=0, device=device)
        for count, first, last in ((timed, False, False), (0, True, False), (0, False, True))
    )
    # The runtime's recipe (runtime.precision): bf16 weights on fp32 masters, whose grads the
    # backward passes accumulate as a run's do.
    layer_weights, _, _ = (MasterWeights(stage, dtype) for stage in (layers, embed, head))
    gen = torch.Generator().manual_seed(rank // tp)  # a TP group's ranks see the same batch
    out = {}
    for b in micro_batches:
        shape = (b, model.seq_len, model.hidden)
        tokens = torch.randint(0, model.vocab, (b, model.seq_len), generator=gen).to(device)
        hidden = torch.randn(*shape, generator=gen).to(device=device, dtype=floating)
        grad = torch.randn(*shape, generator=gen).to(device=device, dtype=floating)

        def layer_pass(x=hidden, grad=grad):
            x = x.detach().requires_grad_()
            return layers(x), lambda y: y.backward(grad)

        def embed_pass(tokens=tokens, grad=grad):
            return embed(tokens), lambda y: y.backward(grad)

        def head_pass(x=hidden, tokens=tokens):  # the loss in fp32 (a no-op in fp32)
            x = x.detach().requires_grad_()
            return head.loss(head(x).float(), tokens), lambda loss: loss.backward()

        def recompute_pass(x=hidden, grad=grad):  # as the runtime's full recomputation runs a stage
            x = x.detach().requires_grad_()
            return layers(x, recompute=Recompute.FULL), lambda y: y.backward(grad)

        layer = _time_passes(layer_pass, together, repeats, clock)
        recompute = _time_passes(recompute_pass, together, repeats, clock)
        embed_f, embed_b, *_ = _time_passes(embed_pass, together, repeats, clock)
        head_f, head_b, *_ = _time_passes(head_pass, together, repeats, clock)
        one = layers.layers["0"]
        out[b] = {
            "layer_forward_s": layer.forward / timed,
            "layer_backward_s": layer.backward / timed,
            "layer_recompute_forward_s": recompute.forward / timed,
            "layer_recompute_backward_s": recompute.backward / timed,
            "embed_forward_s": embed_f,
            "embed_backward_s": embed_b,
            "head_forward_s": head_f,
            "head_backward_s": head_b,
            "layer_time_spread": layer.spread_s,
            "layer_time_cv": layer.variation,
            "layer_activation_bytes": float(saved_bytes(one, hidden)),
            "layer_param_bytes": float(sum(p.numel() * p.element_size() for p in one.parameters())),
        }
    optimizer = _optimizer_seconds_per_param(layer_weights, together, repeats, clock)
    for costs in out.values():
        costs["optimizer_s_per_param"] = optimizer
    return out


def _nothing() -> None:
    return None


class _Alone:
    """One process measuring: nobody to start with or to wait for."""

    def start(self) -> None:
        return None

    def stay_until_all_done(self, run: Callable[[], object]) -> None:
        return None


class _Together:
    """Ranks measuring at once: they start each measurement together, and each keeps running
    untimed passes of it after its timed ones until every rank has finished its own.

    Without the untimed passes, the ranks that finish first stop computing, and the last rank's
    final passes run with the cores to themselves: a short measurement (the head, the embedding,
    the optimizer, a few ms each) then ran with half the ranks computing, and 4 ranks' head pass
    on 2 cores measured as fast as 2 ranks' (3.4-6.7 ms over three profiles, against 6.5 ms for
    2), which priced a 4-rank pipeline's last stage short. A TP group decides together, so that
    its ranks run the same passes and their collectives pair up.
    """

    def __init__(self, tp_group) -> None:
        self.tp_group = tp_group

    def start(self) -> None:
        dist.barrier()

    def stay_until_all_done(self, run: Callable[[], object]) -> None:
        everyone = dist.barrier(async_op=True)
        while True:
            done = torch.tensor([int(everyone.is_completed())])
            if self.tp_group is not None:  # stop only when the whole TP group has seen it
                dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.tp_group)
            if done.item():
                break
            run()
        everyone.wait()


class Passes(NamedTuple):
    """What _time_passes measured."""

    forward: float
    """Mean seconds of a forward."""
    backward: float
    """Mean seconds of a backward."""
    spread_s: float
    """The variance of a pass's time (forward and backward) over its mean: seconds. Where ranks
    share the cores, the scheduler's slices make a pass's time vary, the more the longer it
    runs: an operation of T seconds varies by about sqrt(spread_s * T)."""
    variation: float
    """The passes' coefficient of variation: their standard deviation over their mean."""


def _time_passes(
    run: Callable,
    together: _Together | _Alone,
    repeats: int,
    clock: HostClock | DeviceClock | None = None,
) -> Passes:
    """Mean forward and backward seconds of ``run()`` -> (output, backward function), and the
    passes' spread.

    The ranks start together and then run their passes back to back, as the runtime does: a
    barrier before every pass would stagger short passes so that they hardly overlap, and
    contention for the cores would go unmeasured; and they keep running them, untimed, until all
    have finished (``together``). ``clock`` (runtime.timeline.step_clock, the
    one a run's step is timed by) marks each pass's start, the end of its forward and its end
    (default: the host's, a CPU's); on an accelerator they are device events, read only after
    the last pass, with no synchronize between a forward and its backward (one in between kept
    the host from queueing kernels ahead as a step does, and priced an H200 step 17% slow).
    """
    clock = clock or HostClock()
    marks = []

    def one_pass() -> tuple:
        started = clock.mark()
        out, back = run()
        middle = clock.mark()
        back(out)
        return started, middle, clock.mark()

    together.start()
    for i in range(WARMUP + repeats):
        passed = one_pass()
        if i >= WARMUP:
            marks.append(passed)
    together.stay_until_all_done(one_pass)
    clock.wait(marks[-1][2])
    forward = [clock.seconds(started, middle) for started, middle, _ in marks]
    backward = [clock.seconds(middle, ended) for _, middle, ended in marks]
    passes = [f + b for f, b in zip(forward, backward)]
    # The plain mean, stalls included: what a step adds up. With ranks sharing the cores an
    # operation now and then takes 2-6x its median (the scheduler), and dropping the extremes
    # priced 4-rank TP layers up to 13% short.
    mean = statistics.fmean(passes)
    spread = statistics.pvariance(passes) / mean if mean > 0 else 0.0
    variation = statistics.pstdev(passes) / mean if mean > 0 else 0.0
    return Passes(statistics.fmean(forward), statistics.fmean(backward), spread, variation)


def saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct tensors a forward of ``module`` on ``x`` keeps for its backward
    (its input included; its parameters and buffers not: a stage holds those once, whatever
    the micro-batches in flight, e.g. a Llama stage's rotary tables)."""
    held = [*module.parameters(), *module.buffers()]
    params = {p.untyped_storage().data_ptr() for p in held}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x.detach().requires_grad_())
    return sum(kept.values())


def _optimizer_seconds_per_param(
    weights: MasterWeights,
    together: _Together | _Alone,
    repeats: int,
    clock: HostClock | DeviceClock | None = None,
) -> float:
    """The runtime's update, as Engine.update runs it (runtime.optimizer.PlainAdamW: AdamW,
    fused where the device has it, over the rank's flat fp32 weights, then, in bf16, the copy
    into the stage's bf16 weights), per parameter."""
    params = weights.parameters()
    weights.main_grads.normal_()
    # with the decay a run applies by default (a foreach multiply of the decayed weights)
    optimizer = PlainAdamW(weights, DEFAULT_SETTINGS.lr, DEFAULT_SETTINGS.weight_decay)
    step = optimizer.step
    step()  # allocates the moments
    clock = clock or HostClock()
    clock.wait(clock.mark())  # the first step's work done before the timed ones start
    together.start()
    started = clock.mark()
    for _ in range(repeats):
        step()
    ended = clock.mark()
    together.stay_until_all_done(step)
    clock.wait(ended)
    return clock.seconds(started, ended) / repeats / sum(p.numel() for p in params)


# --- links -------------------------------------------------------------------------------------


def measure_links(
    device_name: str,
    ranks_list: Sequence[int] = (2,),
    sizes: Sequence[int] = LINK_SIZES,
    *,
    concurrent_ranks: int = 1,
    repeats: int = LINK_REPEATS,
    timeout_s: float = 600.0,
) -> LinkProfile:
    """Point-to-point, all-reduce, broadcast, all-gather and reduce-scatter speed between gloo
    processes of this machine: the time at each of ``sizes`` (bytes), and latency + bytes /
    bandwidth fitted to them.

    ``max(concurrent_ranks, max(ranks_list))`` processes take part: messages go between pairs of
    them, each collective of r ranks runs in as many disjoint groups of r as fit, all at once.
    """
    ranks_list = tuple(sorted(set(ranks_list)))
    if (
        not ranks_list
        or min(ranks_list) < 2
        or concurrent_ranks <= 0
        or not sizes
        or min(sizes) < 64
    ):
        raise HethubError(
            f"link profile: ranks {ranks_list} must be at least 2, concurrent ranks "
            f"{concurrent_ranks} positive, sizes at least 64 bytes"
        )
    world, load_before = max(concurrent_ranks, *ranks_list), load_average()
    per_rank = run_ranks(_link_rank, world, ranks_list, tuple(sizes), repeats, timeout_s=timeout_s)
    fits: dict[tuple[str, int], tuple[float, float]] = {}
    measured: dict[tuple[str, int], tuple[tuple[int, float], ...]] = {}
    for kind, ranks in {k for rank in per_rank for k in rank}:
        leaders = [rank[(kind, ranks)] for rank in per_rank if (kind, ranks) in rank]
        points = [
            (n, statistics.fmean(leader[n] for leader in leaders)) for n in sorted(set(sizes))
        ]
        fits[(kind, ranks)] = fit_latency_bandwidth(points)
        measured[(kind, ranks)] = non_decreasing(points)
    latency, bandwidth = fits[("p2p", 2)]
    return LinkProfile(
        device=device_name,
        concurrent_ranks=concurrent_ranks,
        p2p_latency_s=latency,
        p2p_bytes_per_s=bandwidth,
        **{kind: {r: fits[(kind, r)] for r in ranks_list} for kind in COLLECTIVES},
        measured_at=_now(),
        points=measured,
        measured_on=measured_here(torch.device("cpu"), load_before),
    )


def non_decreasing(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """(bytes, seconds) by increasing size, each time at most that of any larger size: a message
    never takes longer than a larger one, so a small size's slower time is noise (a stall)."""
    out, fastest = [], float("inf")
    for n, t in sorted(points, reverse=True):
        fastest = min(fastest, t)
        out.append((n, fastest))
    return tuple(reversed(out))


def fit_latency_bandwidth(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency_s, bytes_per_s) of t = latency + bytes / bandwidth, least squares on the relative
    error (small messages count as much as large ones); the latency is never negative."""
    rows = [(1.0 / t, n / t) for n, t in points]  # each equation divided by its own time
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    y1, y2 = sum(a for a, _ in rows), sum(b for _, b in rows)  # right-hand side: t / t = 1
    det = s11 * s22 - s12 * s12
    latency, per_byte = (
        ((s22 * y1 - s12 * y2) / det, (s11 * y2 - s12 * y1) / det) if det > 0 else (-1.0, 0.0)
    )
    if per_byte <= 0:  # no size dependence measurable: a constant time
        per_byte = _FASTEST_PER_BYTE
        latency = max((y1 - per_byte * s12) / s11, 0.0)
    elif latency < 0:  # no latency measurable: bandwidth alone
        latency, per_byte = 0.0, y2 / s22
    return latency, 1.0 / per_byte


_FASTEST_PER_BYTE = 1e-15  # 1 PB/s: "too fast to measure" as a finite bandwidth


def _link_rank(
    rank: int, world: int, ranks_list: tuple[int, ...], sizes: tuple[int, ...], repeats: int
) -> dict[tuple[str, int], dict[int, float]]:
    """On one rank: mean seconds per size of each measurement this rank leads. Every group
    starts each size together and then repeats its operation back to back, as the runtime's
    gradient sync does."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    pairs = world // 2 * 2
    for n in sizes:
        buffer = torch.zeros(n // 4)
        peer = rank ^ 1
        if rank >= pairs:
            op = _nothing
        elif rank % 2 == 0:  # ping-pong: half the round trip is one message

            def op(buffer=buffer, peer=peer):
                dist.send(buffer, peer)
                dist.recv(buffer, peer)
        else:

            def op(buffer=buffer, peer=peer):
                dist.recv(buffer, peer)
                dist.send(buffer, peer)

        seconds = _series(op, _repeats(n, repeats)) / 2
        if rank < pairs and rank % 2 == 0:
            out.setdefault(("p2p", 2), {})[n] = seconds
    for r in ranks_list:
        group = _block_group(world, r, Role.MEASURE)
        members = dist.get_process_group_ranks(group) if group is not None else None
        for kind in COLLECTIVES:
            for n in sizes:
                op = _collective(kind, n, r, group, members) if group is not None else _nothing
                seconds = _series(op, _repeats(n, repeats))
                if members is not None and rank == members[0]:
                    out.setdefault((kind, r), {})[n] = seconds
    return out


def _series(op: Callable[[], None], repeats: int) -> float:
    """Every rank starts together, then ``op`` runs back to back: its mean seconds, stalls
    included. Not a trimmed mean: a gloo collective of a few hundred microseconds stalls for
    milliseconds every few dozen calls, and a gradient sync of ~75 tensors meets those stalls.
    (Measured here: 40 all-reduces of 768 bytes, 0.27 ms each without the extremes, 0.38 ms
    each over the whole series.)"""
    dist.barrier()
    op()  # warms up
    started = time.perf_counter()
    for _ in range(repeats):
        op()
    return (time.perf_counter() - started) / repeats


def _repeats(nbytes: int, repeats: int) -> int:
    return 8 * repeats if nbytes < SMALL_MESSAGE else repeats


def _collective(
    kind: str, nbytes: int, ranks: int, group, members: list[int]
) -> Callable[[], None]:
    if kind == "allgather":
        piece = torch.zeros(max(1, nbytes // 4 // ranks))
        pieces = [torch.empty_like(piece) for _ in range(ranks)]
        return lambda: dist.all_gather(pieces, piece, group=group)
    if kind == "reducescatter":
        # As a sharded optimizer's sync reduces a bucket (runtime.engine): the gradients copied
        # into one flat buffer, padded to a multiple of the ranks; each keeps its slice of the sum.
        flat = torch.zeros(max(1, nbytes // 4 // ranks) * ranks)
        mine = torch.empty(flat.numel() // ranks)
        return lambda: dist.reduce_scatter_single(mine, torch.cat([flat]), group=group)
    tensor = torch.zeros(nbytes // 4)
    if kind == "broadcast":
        return lambda: dist.broadcast(tensor, members[0], group=group)

    def bucket_allreduce() -> None:
        # As the runtime's gradient sync reduces a bucket: the gradients copied into one flat
        # buffer, reduced, copied back. The copies cost a quarter of a 14 MB bucket's sync here.
        flat = torch.cat([tensor.view(-1)])
        dist.all_reduce(flat, group=group)
        tensor.copy_(flat)

    return bucket_allreduce


# --- both, incrementally -----------------------------------------------------------------------


def ensure_profiles(
    directory: str | Path,
    model: ModelSpec,
    device_name: str,
    tps: Sequence[int],
    micro_batches: Sequence[int],
    *,
    threads: int = 1,
    concurrent_ranks: int = 1,
    ranks_list: Sequence[int] | None = None,
    repeats: int = REPEATS,
    link_repeats: int = LINK_REPEATS,
    links: bool = True,
    progress: Callable[[str], None] | None = None,
    dtype: str = DTYPE,
) -> Profiles:
    """Measure what ``directory`` lacks of these layer profiles (in ``dtype``, where
    measuring_device says) and (with ``links``, on a CPU only) of the link profile (with
    collectives over ``ranks_list``, default 2 .. max(concurrent_ranks, 2)), save it there, and
    return the directory's profiles. ``repeats`` and ``link_repeats``: timed repeats of each
    layer pass and of each link message size."""
    where = measuring_device(device_name)
    check_layer_request(
        model,
        tps,
        micro_batches,
        threads=threads,
        concurrent_ranks=concurrent_ranks,
        dtype=dtype,
        device=where,
    )
    links = links and where.type == "cpu"  # gloo between CPU processes is not a GPU's link
    folder = Path(directory)
    have = load_profiles(folder) if folder.is_dir() else empty_profiles(str(folder))
    for tp in dict.fromkeys(tps):
        keys = {
            b: LayerKey.of(
                model,
                device=device_name,
                dtype=dtype,
                threads=threads,
                concurrent_ranks=concurrent_ranks,
                tp=tp,
                micro_batch=b,
            )
            for b in micro_batches
        }
        # A file written before recomputation was measured, or by an older method, counts as
        # missing: measured anew.
        missing = [
            b
            for b, key in keys.items()
            if key not in have.layers
            or have.layers[key].layer_recompute_backward_s is None
            or have.layers[key].method < METHOD
        ]
        if missing:
            if progress:
                # fp32 on a CPU: the line as it always was (the README quotes it).
                how = "" if dtype == "fp32" else f", {dtype}"
                how += "" if where.type == "cpu" else f", on the {describe_device(where)}"
                progress(
                    f"measuring layers: tp {tp}, micro-batch {','.join(map(str, missing))}, "
                    f"{plural(max(concurrent_ranks, tp), 'rank')} at once{how}"
                )
            for profile in measure_layers(
                model,
                device_name,
                [tp],
                missing,
                threads=threads,
                concurrent_ranks=concurrent_ranks,
                repeats=repeats,
                dtype=dtype,
            ):
                save_profile(folder, profile)
    ranks_list = tuple(ranks_list or range(2, max(concurrent_ranks, 2) + 1))
    link = have.link(device_name, concurrent_ranks)
    if links and (
        link is None
        or link.method < METHOD
        or any(r not in link.allreduce or r not in link.reducescatter for r in ranks_list)
    ):
        if progress:
            progress(
                f"measuring links: collectives over {','.join(map(str, ranks_list))} ranks, "
                f"{max(concurrent_ranks, *ranks_list)} processes"
            )
        wanted = sorted(
            set(ranks_list) | set(link.allreduce if link and link.method == METHOD else ())
        )
        save_profile(
            folder,
            measure_links(
                device_name, wanted, concurrent_ranks=concurrent_ranks, repeats=link_repeats
            ),
        )
    return load_profiles(folder)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
