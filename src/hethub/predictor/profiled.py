"""Pricing from measured profiles (hethub.profiles): what the runtime does, with this machine's
numbers in place of the analytic model's.

Compute: a stage's forward is its layers' measured forwards plus the embedding (first stage) and
the head with the cross-entropy (last stage); backward likewise. With full recomputation the
layers take their measured checkpointed times, and the embedding's and head's forwards run again;
with selective recomputation, which profiles do not measure, a layer's backward is its measured
one plus its measured forward's share that the analytic model gives the rerun attention.
TP collectives are inside the measured times. Where a local run has more ranks than the machine
has cores, core_sharing() says how the ranks share them (predictor.sharing).
Communication, as the runtime (hethub.runtime.engine) does it: the two stages' leaders exchange
whole activations (and their gradients) point to point, the receiver broadcasts them to its TP
group; the gradient sync's collectives are the stage leader's in the plan of a step's transfers
(spec.collectives.rank_transfers), which the runtime's counted bytes are held to: bucket by
bucket, gathered in the TP group, summed among the holders' leaders, broadcast back.
Memory: weights, gradients and both AdamW
moments in the profile's dtype, and the measured activations of the micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import NamedTuple

from hethub.memo import memoized
from hethub.predictor.memory import stage_params
from hethub.predictor.sharing import CoreSharing
from hethub.predictor.stage import SendTimes, StagePosition, StageTimes, SyncTimes
from hethub.profiles.selection import Profiles
from hethub.profiles.types import METHOD, LayerKey, LayerProfile, LinkProfile
from hethub.report.terminal import plural
from hethub.spec.cluster import ClusterSpec
from hethub.spec.collectives import (
    BRIDGE,
    NATIVE,
    Kind,
    MessageCut,
    Phase,
    rank_transfers,
    ring_steps,
    shard_degrees,
)
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan, Precision, Recompute
from hethub.spec.topology import Topology, build_topology, parameter_holders


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
    profile: LayerProfile,
    layers: int,
    recompute: Recompute,
    position: StagePosition,
    selective_share: float = 0.0,
) -> StageTimes:
    """Forward and backward seconds of one micro-batch through a stage, from its measured pieces.

    With full recomputation the runtime checkpoints each layer: the layers take their measured
    checkpointed times (forward + backward where the profile lacks them); the embedding and
    the head, not checkpointed, their plain ones. With selective recomputation, which a profile
    does not measure, a layer's backward is its measured one plus ``selective_share`` of its
    measured forward (compute.selective_rerun_share: the analytic model's share of the
    attention's inner part in the forward).
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
    if recompute == Recompute.SELECTIVE:
        backward += layers * selective_share * profile.layer_forward_s
    ends = [(profile.embed_forward_s, profile.embed_backward_s)] * position.first
    ends += [(profile.head_forward_s, profile.head_backward_s)] * position.last
    for f, b in ends:
        forward, backward = forward + f, backward + b
    return StageTimes(forward, backward)


def send_times(
    link: LinkProfile, cut: MessageCut, element_bytes: int, *, tp_sender: int, tp_receiver: int
) -> SendTimes | None:
    """(activation forward, its gradient backward) over one stage boundary on one link profile:
    each TP rank's run of the message cut as ``cut`` says (spec.collectives.message_cut,
    shard_pieces), then, cut flat, the receiving stage's all-gather of the runs; None where an
    all-gather was not measured."""
    return cross_send_times(
        link, link, link, cut, element_bytes, tp_sender=tp_sender, tp_receiver=tp_receiver
    )


def cross_send_times(
    between: LinkProfile,
    link_a: LinkProfile | None,
    link_b: LinkProfile | None,
    cut: MessageCut,
    element_bytes: int,
    *,
    tp_sender: int,
    tp_receiver: int,
) -> SendTimes | None:
    """(activation forward, its gradient backward) of a message cut as ``cut`` says, of
    ``element_bytes`` elements, over a boundary: the busiest rank's pieces over the measured
    link ``between`` the stages, then, cut flat, the all-gather in the receiving stage, priced
    by that stage's own link profile (``link_b`` forward, ``link_a`` backward; nothing for a
    stage whose TP rank holds the whole message); None where an all-gather is needed and not
    measured."""
    nbytes = cut.numel * element_bytes
    sender, receiver = shard_degrees(cut.positions, tp_sender, tp_receiver)
    message = between.p2p_time(nbytes / min(sender, receiver))
    if not cut.gathered:  # sequence parallel: each rank keeps its tokens
        return SendTimes(message, message)
    forward = _all_gather(link_b, nbytes, receiver)
    backward = _all_gather(link_a, nbytes, sender)
    if forward is None or backward is None:
        return None
    return SendTimes(message + forward, message + backward)


def _all_gather(link: LinkProfile | None, nbytes: float, ranks: int) -> float | None:
    if ranks <= 1:
        return 0.0
    return None if link is None else link.allgather_time(nbytes, ranks)


@memoized
def plan_topology(plan: Plan, cluster: ClusterSpec) -> Topology:
    """spec.topology's ranks of ``plan`` on ``cluster``, built once per plan: every stage's
    sync reads it."""
    return build_topology(plan, cluster)


_MEASURED = {
    Kind.ALL_REDUCE: LinkProfile.allreduce_time,
    Kind.REDUCE_SCATTER: LinkProfile.reducescatter_time,
    Kind.ALL_GATHER: LinkProfile.allgather_time,
    Kind.BROADCAST: LinkProfile.broadcast_time,
}


class Collective(NamedTuple):
    """One collective of a rank's gradient sync, as a link profile times it."""

    kind: Kind
    nbytes: int
    """The whole tensor (an all-gather's output)."""
    ranks: int
    after_step: bool = False
    """A sharded optimizer's all-gather of the updated weights, after its step."""
    exchange: bool = False
    """The sum among a bucket's holders in its classes (spec.slices.sync_classes): it waits for
    every holder's backwards."""
    path: str = NATIVE
    """NATIVE inside a vendor, BRIDGE across vendors (spec.collectives.path_of)."""


@memoized
def sync_collectives(
    plan: Plan, cluster: ClusterSpec, model: ModelSpec, pipeline: int, stage: int
) -> tuple[Collective, ...]:
    """The collectives the leader of stage ``stage`` of layout ``pipeline`` runs to sync its
    gradients, in order: its gradient sync's and a sharded optimizer's gathers in the plan of a
    step's transfers (spec.collectives.rank_transfers), which the runtime's bytes are held to."""
    topology = plan_topology(plan, cluster)
    replica = sum(p.count for p in plan.pipelines[:pipeline])  # the layout's first replica
    leader = topology.stage_ranks(replica, stage)[0]
    transfers = rank_transfers(
        plan, topology, model, topology.vendors(cluster), leader, grad_norm=False
    )
    return tuple(
        Collective(
            t.kind,
            t.nbytes * len(t.ranks) if t.kind is Kind.ALL_GATHER else t.nbytes,
            len(t.ranks),
            after_step=t.phase is Phase.PARAM_GATHER,
            exchange=t.phase is Phase.GRAD_EXCHANGE,
            path=t.path,
        )
        for t in transfers
        if t.phase in (Phase.GRAD_SYNC, Phase.GRAD_EXCHANGE, Phase.PARAM_GATHER)
    )


def grad_sync_time(
    link: LinkProfile, collectives: Sequence[Collective], bridge: Sequence[LinkProfile] = ()
) -> SyncTimes | None:
    """The measured time of a rank's gradient sync (sync_collectives): a native collective on
    its vendor's ``link``, a bridged one as a ring over the slowest of the ``bridge`` links
    (the measured links between its kinds' nodes, point to point: ring_over); None where a
    collective was not measured (a bridged one with no ``bridge`` link)."""
    reduce, gather, exchange = [], [], []
    for c in collectives:
        if c.path == BRIDGE:
            time = max((ring_over(b, c) for b in bridge), default=None)
        else:
            time = _MEASURED[c.kind](link, c.nbytes, c.ranks)
        (gather if c.after_step else reduce).append(time)
        if c.exchange:
            exchange.append(time)
    if None in reduce or None in gather:
        return None
    return SyncTimes(sum(reduce), sum(gather), sum(exchange))


def ring_over(link: LinkProfile, collective: Collective) -> float:
    """``collective`` as a ring runs it over a point-to-point ``link``: its ring_steps
    messages one after the other, each a 1/n share of the tensor (the whole of it for a
    broadcast), as the Communicator moves it (spec.collectives.moved_bytes)."""
    kind, ranks = collective.kind, collective.ranks
    share = collective.nbytes if kind is Kind.BROADCAST else collective.nbytes / ranks
    return ring_steps(kind, ranks) * link.p2p_time(share)


def optimizer_time(
    profile: LayerProfile,
    model: ModelSpec,
    tp: int,
    layers: int,
    position: StagePosition,
) -> float:
    """The AdamW step over one rank's share of the stage's parameters."""
    return profile.optimizer_s_per_param * stage_params(model, layers, position) / tp


def core_sharing(
    plan: Plan, cluster: ClusterSpec, model: ModelSpec, profiles: Profiles
) -> CoreSharing | None:
    """How the plan's ranks share the cores of the machine its profiles were measured on, or None
    where they do not: the profiles are selected for a local run of more ranks at once than that
    machine has cores (the cores each layer profile records), and hold the plan's layers.

    ``alone``: a layer's measured time with its TP group alone on the machine, as a share of its
    time with all of the job's ranks at once, averaged over the plan's TP degrees; where the
    profiles lack the former, the fair share of the cores (cores / ranks). ``spread_s``: the
    layer profiles' spread of a pass's time, averaged (0 in a profile of an older method).
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
        spread_s=statistics.fmean(p.layer_time_spread for p in measured if p is not None),
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
        elif (
            any(s.recompute == Recompute.FULL for p in plan.pipelines for s in p.stages)
            and profile.layer_recompute_backward_s is None
        ):
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
    holders = parameter_holders(plan_topology(plan, cluster), model)
    needed = {len(leaders) for leaders in holders.values() if len(leaders) > 1}
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
