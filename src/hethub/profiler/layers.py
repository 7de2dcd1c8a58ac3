"""Measure what the runtime executes: its own stage modules (hethub.runtime.model) forward and
backward, in fp32 or bf16, on this machine's CPU or its GPU (links: profiler.links; what is
measured afresh and what is reused: profiler.ensure).

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
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from hethub.errors import HethubError
from hethub.profiler.conditions import (
    available_cores,
    block_group,
    describe_device,
    measured_here,
    measuring_device,
    timestamp,
)
from hethub.profiles.machine import load_average
from hethub.profiles.types import MEASURED_TIMES, LayerKey, LayerProfile
from hethub.runtime.model import Stage
from hethub.runtime.optimizer import PlainAdamW
from hethub.runtime.precision import COMPUTE_DTYPE, MasterWeights
from hethub.runtime.process_groups import Role
from hethub.runtime.rundir import DEFAULT_SETTINGS
from hethub.runtime.spawn import run_ranks
from hethub.runtime.timeline import DeviceClock, HostClock, step_clock
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
    stamp, load_before = timestamp(), load_average()
    measured: list[tuple[LayerKey, dict[str, float]]] = []
    for tp in dict.fromkeys(tps):
        world = max(concurrent_ranks, tp)
        args = (_RankRequest(model, tp, tuple(micro_batches), repeats, dtype, str(where)),)
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


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _in_this_process(fn: Callable, threads: int, *args):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(0, 1, *args)
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class _RankRequest:
    """What each measuring rank measures: ``model``'s layers at TP ``tp``, for each of
    ``micro_batches``, ``repeats`` times, in ``dtype`` on device ``where``."""

    model: ModelSpec
    tp: int
    micro_batches: tuple[int, ...]
    repeats: int
    dtype: str = DTYPE
    where: str = "cpu"


def _measure_rank(rank: int, world: int, request: _RankRequest) -> dict[int, dict[str, float]]:
    """On one rank: the mean costs of each micro-batch size (all ranks measure at once), with the
    stage's weights and activations in the request's dtype on its device."""
    model, tp, micro_batches = request.model, request.tp, request.micro_batches
    repeats, dtype, where = request.repeats, request.dtype, request.where
    device, floating = torch.device(where), DTYPES[dtype]
    group = block_group(world, tp, Role.TENSOR) if world > 1 else None
    together = _ConcurrentTiming(group) if world > 1 else _OneRankTiming()
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


class _OneRankTiming:
    """One process measuring: nobody to start with or to wait for."""

    def start(self) -> None:
        return None

    def stay_until_all_done(self, run: Callable[[], object]) -> None:
        return None


class _ConcurrentTiming:
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
    together: _ConcurrentTiming | _OneRankTiming,
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
    together: _ConcurrentTiming | _OneRankTiming,
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
