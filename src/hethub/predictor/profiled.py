"""Pricing from measured profiles (hethub.profiles): what the runtime does, with this machine's
numbers in place of the analytic model's.

Compute: a stage's forward is its layers' measured forwards plus the embedding (first stage) and
the head with the cross-entropy (last stage); backward likewise. With full recomputation the
layers take their measured checkpointed times, and the embedding's and head's forwards run again.
TP collectives are inside the measured times. Where a local run has more ranks than the machine
has cores, core_sharing() says how the ranks share them (predictor.sharing).
Communication, as the runtime (hethub.runtime.engine) does it: the two stages' leaders exchange
whole activations (and their gradients) point to point, the receiver broadcasts them to its TP
group; the gradient sync goes in buckets of the tensors with the same holders (spec.buckets):
the TP group gathers each full gradient, the leaders of every stage holding the bucket
all-reduce it, the leader broadcasts it back. Memory: weights, gradients and both AdamW
moments in the profile's dtype, and the measured activations of the micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import NamedTuple

from hethub.predictor.memory import GB, StageMemory, activation_bytes, stage_params
from hethub.predictor.sharing import CoreSharing
from hethub.predictor.stage import SendTimes, StagePosition, StageTimes
from hethub.profiles.store import METHOD, LayerKey, LayerProfile, LinkProfile, Profiles
from hethub.report.text import plural
from hethub.spec.buckets import MAIN_GRAD_BYTES, bucket_bounds
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan, Precision, Recompute


def for_precision(profiles: Profiles, precision: Precision) -> Profiles:
    """``profiles`` looked up under the dtype of a plan's precision (the rest of their run
    conditions kept): an fp32 plan is priced by fp32 profiles, a bf16 plan by bf16 ones."""
    if profiles.dtype == precision.value:
        return profiles
    return profiles.select(
        dtype=precision.value,
        threads=profiles.threads,
        concurrent_ranks=profiles.concurrent_ranks,
    )


def profiled_work(
    profile: LayerProfile, layers: int, recompute: Recompute, position: StagePosition
) -> StageTimes:
    """Forward and backward seconds of one micro-batch through a stage, from its measured pieces.

    With full recomputation the runtime checkpoints the whole stage: its layers take their
    measured checkpointed times (forward + backward where the profile lacks them), and the
    embedding's and head's forwards run again before their backwards.
    """
    full = recompute == Recompute.FULL
    measured = full and None not in (
        profile.layer_recompute_forward_s,
        profile.layer_recompute_backward_s,
    )
    forward = layers * (profile.layer_recompute_forward_s if measured else profile.layer_forward_s)
    backward = layers * (
        profile.layer_recompute_backward_s if measured else profile.layer_backward_s
    )
    if full and not measured:
        backward += forward
    ends = [(profile.embed_forward_s, profile.embed_backward_s)] * position.first
    ends += [(profile.head_forward_s, profile.head_backward_s)] * position.last
    for f, b in ends:
        forward, backward = forward + f, backward + b + (f if full else 0.0)
    return StageTimes(forward, backward)


def send_times(
    link: LinkProfile, nbytes: float, tp_sender: int, tp_receiver: int
) -> SendTimes | None:
    """(activation forward, its gradient backward) over one stage boundary: leader to leader,
    then a broadcast inside the receiving TP group; None where a broadcast was not measured."""
    message = link.p2p_time(nbytes)
    forward, backward = (
        link.broadcast_time(nbytes, tp_receiver),
        link.broadcast_time(nbytes, tp_sender),
    )
    if forward is None or backward is None:
        return None
    return SendTimes(message + forward, message + backward)


def cross_send_times(
    between: LinkProfile,
    link_a: LinkProfile | None,
    link_b: LinkProfile | None,
    nbytes: float,
    tp_sender: int,
    tp_receiver: int,
) -> SendTimes | None:
    """(activation forward, its gradient backward) over a boundary between two nodes: the
    leaders' message over the measured link between them, then a broadcast in the receiving TP
    group, priced by that group's own link profile (nothing for a TP group of one); None where
    a broadcast is needed and not measured."""
    message = between.p2p_time(nbytes)
    forward = _broadcast(link_b, nbytes, tp_receiver)
    backward = _broadcast(link_a, nbytes, tp_sender)
    if forward is None or backward is None:
        return None
    return SendTimes(message + forward, message + backward)


def _broadcast(link: LinkProfile | None, nbytes: float, tp: int) -> float | None:
    if tp <= 1:
        return 0.0
    return None if link is None else link.broadcast_time(nbytes, tp)


@functools.lru_cache(maxsize=4096)
def param_tensors(
    model: ModelSpec, layers: int, position: StagePosition
) -> tuple[tuple[str, int, bool], ...]:
    """(what, elements of the full tensor, sharded over TP) of every parameter tensor a stage
    holds, as hethub.runtime.model builds them; what is "embed" for the (tied) embedding, else
    "other"."""
    h, f, q, kv = model.hidden, model.ffn_hidden, model.heads * model.head_dim, model.kv_hidden
    gpt = model.arch == "gpt"
    layer = [("other", h, False)] * 2 + [
        ("other", q * h, True),
        ("other", kv * h, True),
        ("other", kv * h, True),
        ("other", h * h, True),
    ]
    if gpt:
        layer += [("other", f * h, True), ("other", h * f, True)]  # fc1, fc2
        layer += [("other", h, False)] * 2  # norm biases
        layer += [
            ("other", q, True),
            ("other", kv, True),
            ("other", kv, True),
            ("other", h, False),
        ]  # q k v o
        layer += [
            ("other", f, True),
            ("other", h, False),
        ]  # fc1 (column: sharded), fc2 (row: whole)
    else:
        layer += [("other", f * h, True)] * 3  # gate, up, down
    tensors = []
    if position.first:
        tensors.append(("embed", model.vocab * h, True))
        if gpt:
            tensors.append(("other", model.seq_len * h, False))  # learned positions
    tensors += layer * layers
    if position.last:
        tensors += [("other", h, False)] * (2 if gpt else 1)  # final norm
        if not gpt:
            tensors.append(("other", model.vocab * h, True))  # the output head
        elif not position.alone:
            tensors.append(
                ("embed", model.vocab * h, True)
            )  # the tied head's copy of the embedding
    return tuple(tensors)


def holders(plan: Plan, model: ModelSpec) -> tuple[int, int]:
    """(stages holding each layer, stages holding the embedding) over all replicas: every replica
    holds every layer once; gpt's tied head keeps a copy of the embedding on each last stage."""
    replicas = sum(p.count for p in plan.pipelines)
    if model.arch != "gpt":
        return replicas, replicas
    return replicas, sum(p.count * (1 if len(p.stages) == 1 else 2) for p in plan.pipelines)


class SyncTimes(NamedTuple):
    """A stage's gradient sync on one rank, in the two parts the step puts apart."""

    reduce_s: float
    """The gradients' sum (all-reduce, or a sharded optimizer's reduce-scatter): before the
    optimizer step, and what an overlapped sync can hide behind the backwards."""
    gather_s: float
    """A sharded optimizer's all-gather of the updated weights: after its step."""


def grad_sync_time(
    link: LinkProfile,
    model: ModelSpec,
    *,
    tp: int,
    layers: int,
    position: StagePosition,
    holders: int,
    embed_holders: int,
    peers: int,
    sharded: bool,
    direct: bool,
    weight_bytes: int,
) -> SyncTimes | None:
    """One rank's gradient sync of a stage, as the runtime buckets it (spec.buckets); None where
    a collective was not measured.

    ``holders``: stages (of all replicas) holding each layer; ``embed_holders``: those holding
    the embedding (with gpt's tied head, the last stages too); ``peers``: the replicas of this
    stage's identical layouts, which a sharded optimizer (``sharded``) shares among. Tensors with
    the same holders share buckets. A bucket held by exactly the peers, where the plan shards or
    overlaps (``direct``), is summed among them by each TP rank for its own shards: a
    reduce-scatter when sharded, else an all-reduce. Any other bucket's sharded tensors are first
    gathered in the TP group, the bucket all-reduced and broadcast back to the TP group. The
    gradients are fp32 in either precision (bf16 sums its main gradients); a sharded optimizer
    then all-gathers each bucket's updated weights (``weight_bytes`` an element) among the peers.
    The runtime fills buckets in full-model name order, priced here in building order: the two
    differ only in where a bucket of a stage over BUCKET_BYTES ends.
    """
    by_holders: dict[int, list[tuple[int, bool]]] = {}
    for what, elements, over_tp in param_tensors(model, layers, position):
        ranks = embed_holders if what == "embed" else holders
        if ranks > 1:
            by_holders.setdefault(ranks, []).append((elements, over_tp))
    reduce, gather = [], []
    for ranks, tensors in by_holders.items():
        local = [elements // tp if over_tp else elements for elements, over_tp in tensors]
        # the runtime cuts buckets by each tensor's full fp32 size, whatever the TP degree
        bounds = bucket_bounds([elements * MAIN_GRAD_BYTES for elements, _ in tensors])
        if direct and ranks == peers:
            summed = link.reducescatter_time if sharded else link.allreduce_time
            reduce += [
                summed(sum(local[start:stop]) * MAIN_GRAD_BYTES, ranks) for start, stop in bounds
            ]
        else:
            if tp > 1:
                reduce += [
                    link.allgather_time(elements * MAIN_GRAD_BYTES, tp)
                    for elements, over_tp in tensors
                    if over_tp
                ]
            for start, stop in bounds:
                bucket = sum(elements for elements, _ in tensors[start:stop]) * MAIN_GRAD_BYTES
                reduce.append(link.allreduce_time(bucket, ranks))
                if tp > 1:
                    reduce.append(link.broadcast_time(bucket, tp))
        if sharded and peers > 1:
            gather += [
                link.allgather_time(sum(local[start:stop]) * weight_bytes, peers)
                for start, stop in bounds
            ]
    if None in reduce or None in gather:
        return None
    return SyncTimes(sum(reduce), sum(gather))


def optimizer_time(
    profile: LayerProfile,
    model: ModelSpec,
    tp: int,
    layers: int,
    position: StagePosition,
) -> float:
    """The AdamW step over one rank's share of the stage's parameters."""
    return profile.optimizer_s_per_param * stage_params(model, layers, position) / tp


def profiled_memory(
    profile: LayerProfile,
    model: ModelSpec,
    *,
    bytes_per_element: int,
    layers: int,
    tp: int,
    position: StagePosition,
    in_flight: float,
    micro_batch: int,
    recompute: Recompute,
    precision: Precision,
    optimizer_shards: int = 1,
) -> StageMemory:
    """Peak memory of one rank of a stage holding ``in_flight`` micro-batches' activations, with
    the measured activations of a layer, and the state the runtime keeps per parameter under
    ``precision`` (runtime.precision: bf16 weights on fp32 masters, main grads and moments), the
    optimizer's split over ``optimizer_shards`` ranks."""
    params = stage_params(model, layers, position) / tp
    activations = activation_bytes(
        model,
        per_layer=profile.layer_activation_bytes,
        bytes_per_element=bytes_per_element,
        layers=layers,
        tp=tp,
        last=position.last,
        in_flight=in_flight,
        micro_batch=micro_batch,
        recompute=recompute,
        precision=precision,
    )
    return StageMemory(
        params * precision.weight_bytes / GB,
        params * precision.main_grad_bytes / GB,
        params * precision.optimizer_bytes(optimizer_shards) / GB,
        activations / GB,
    )


def core_sharing(
    plan: Plan, cluster: ClusterSpec, model: ModelSpec, profiles: Profiles
) -> CoreSharing | None:
    """How the plan's ranks share the cores of the machine its profiles were measured on, or None
    where they do not: the profiles are selected for a local run of more ranks at once than that
    machine has cores (the cores each layer profile records), and hold the plan's layers.

    ``alone``: a layer's measured time with its TP group alone on the machine, as a share of its
    time with all of the job's ranks at once, averaged over the plan's TP degrees; where the
    profiles lack the former, the fair share of the cores (cores / ranks).
    """
    ranks, pairs = profiles.concurrent_ranks, _device_tps(plan, cluster)
    measured = [profiles.layer_for(device, model, tp, plan.micro_batch) for device, tp in pairs]
    recorded = [p.cores for p in measured if p is not None and p.cores is not None]
    if not recorded or ranks <= min(recorded):
        return None
    shares = []
    for profile in measured:
        alone = None if profile is None else profiles.layer(alone_key(profile))
        if alone is not None:
            shares.append(
                (alone.layer_forward_s + alone.layer_backward_s)
                / (profile.layer_forward_s + profile.layer_backward_s)
            )
    least = min(tp for _, tp in pairs)
    return CoreSharing(
        cores=min(recorded),
        ranks=ranks,
        least=least,
        alone=min(1.0, statistics.fmean(shares)) if shares else min(recorded) / ranks,
    )


def _device_tps(plan: Plan, cluster: ClusterSpec) -> list[tuple[str, int]]:
    """The (accelerator, TP degree) pairs of the plan's stages, each once: what its layers are
    looked up by."""
    return list(
        dict.fromkeys(
            (cluster.group(s.group).accelerator.name, s.tp)
            for p in plan.pipelines
            for s in p.stages
        )
    )


def alone_key(profile: LayerProfile) -> LayerKey:
    """The key of ``profile``'s layers measured with their TP group alone on the machine."""
    return dataclasses.replace(profile.key, concurrent_ranks=profile.key.tp)


def missing_profiles(
    plan: Plan, cluster: ClusterSpec, model: ModelSpec, profiles: Profiles
) -> list[str]:
    """One line per piece of ``plan`` that ``profiles`` lack, which the prediction prices with the
    analytic model instead (looked up under the plan's precision, as predict() does)."""
    profiles = for_precision(profiles, plan.precision)
    notes: list[str] = []
    found: list[LayerProfile] = []
    for device, tp in _device_tps(plan, cluster):
        profile = profiles.layer_for(device, model, tp, plan.micro_batch)
        if profile is not None:
            found.append(profile)
        if profile is None:
            key = profiles.layer_key(device, model, tp, plan.micro_batch)
            notes.append(
                f"no profile for {key.describe()} in {profiles.source or 'the profiles'}: "
                "analytic model"
            )
        elif profile.method < METHOD:
            notes.append(
                f"the profile for {profile.key.describe()} was measured by an older hethub (method "
                f"{profile.method}, now {METHOD}): measure again with hethub profile --again"
            )
        elif plan.recompute == Recompute.FULL and profile.layer_recompute_backward_s is None:
            notes.append(
                f"the profile for {profile.key.describe()} has no recomputed layer times: "
                f"recomputation taken as the forward again"
            )
    sharing = core_sharing(plan, cluster, model, profiles)
    for profile in found if sharing else ():
        if profiles.layer(alone_key(profile)) is None:
            notes.append(
                f"no profile for {alone_key(profile).describe()} in "
                f"{profiles.source or 'the profiles'}: the {profiles.concurrent_ranks} ranks' "
                f"share of the {sharing.cores} cores is taken as fair"
            )
    devices = dict.fromkeys(
        cluster.group(s.group).accelerator.name for p in plan.pipelines for s in p.stages
    )
    needed = {r for r in holders(plan, model) if r > 1}
    for device in devices:
        link = profiles.link_for(device)
        if link is None:
            notes.append(
                f"no link profile for {device} with "
                f"{plural(profiles.concurrent_ranks, 'rank')} at once in "
                f"{profiles.source or 'the profiles'}: analytic communication"
            )
            continue
        if link.method < METHOD:
            notes.append(
                f"the link profile of {device} was measured by an older hethub "
                f"(method {link.method}, "
                f"now {METHOD}): measure again with hethub profile --again"
            )
        tps = {s.tp for p in plan.pipelines for s in p.stages if s.tp > 1}
        lacking = [f"all-reduce over {r} ranks" for r in sorted(needed) if r not in link.allreduce]
        lacking += [f"broadcast over {t} ranks" for t in sorted(tps) if t not in link.broadcast]
        if lacking:
            notes.append(
                f"the link profile of {device} with {plural(profiles.concurrent_ranks, 'rank')} "
                "at once lacks "
                f"{', '.join(lacking)}: analytic communication where it is needed"
            )
    return notes
