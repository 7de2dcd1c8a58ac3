"""The plan of a step's traffic: every message and collective a rank takes part in, with its
ranks, its bytes and its path, as a pure function of the plan (no torch, as spec.schedules and
spec.buckets). The runtime's Communicator counts what it moves by ``moved_bytes`` (the ring
factors live here and nowhere else); the predictor reports the same list's bytes
(``hethub predict --json``: comm_bytes) and prices the gradient sync from it; the dry run walks
its point-to-point posts (``stage_posts``; spec.agreement walks them); and tests hold the runtime's
counted bytes, rank by rank, to this list's.

What a rank counts, as the Communicator counts it: the bytes it moves out of itself. A message
counts once at its sender and once at its receiver; a broadcast once on every rank; an
all-reduce over n ranks 2 (n - 1) / n of its tensor (a ring: a reduce-scatter then an
all-gather); a reduce-scatter (or the funnel's reduce) (n - 1) / n of its input; an all-gather
n - 1 times its piece.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hethub.memo import memo_scope, memoized
from hethub.spec.buckets import BUCKET_BYTES, SyncBucket, rank_buckets
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import parameter_table
from hethub.spec.plan import FP32_BYTES, MAIN_GRAD_BYTES, Plan
from hethub.spec.schedules import BACKWARD, FORWARD, Schedule, chunk_sequence, stage_model_chunks
from hethub.spec.slices import (
    BridgeSlice,
    SyncClass,
    bridge_slices,
    padded_length,
    slice_units,
    sync_classes,
    vendor_parts,
)
from hethub.spec.topology import Topology

NATIVE, BRIDGE = "native", "bridge"


class Kind(enum.StrEnum):
    """What a transfer is: a message's two ends, or a collective."""

    SEND = "send"
    RECV = "recv"
    BROADCAST = "broadcast"
    ALL_REDUCE = "all-reduce"
    REDUCE = "reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"


def moved_bytes(kind: Kind, nbytes: int, ranks: int) -> int:
    """The bytes one rank of ``ranks`` moves in a transfer of ``nbytes`` (the tensor it passes:
    an all-reduce's or a broadcast's tensor, a reduce-scatter's input, an all-gather's piece, a
    message), as a ring runs it; whole bytes, rounded down."""
    if kind in (Kind.SEND, Kind.RECV):
        return nbytes
    if ranks <= 1:
        return 0
    if kind is Kind.BROADCAST:
        return nbytes
    if kind is Kind.ALL_REDUCE:
        return 2 * (ranks - 1) * nbytes // ranks
    if kind in (Kind.REDUCE, Kind.REDUCE_SCATTER):
        return (ranks - 1) * nbytes // ranks
    return (ranks - 1) * nbytes  # an all-gather brings the n - 1 other pieces in


def ring_steps(kind: Kind, ranks: int) -> int:
    """How many messages one rank of a ring sends one after the other in a collective over
    ``ranks`` (each paying the link's latency): 2 (n - 1) for an all-reduce, n - 1 for a
    reduce-scatter or an all-gather, one for a broadcast or a message."""
    if kind in (Kind.SEND, Kind.RECV):
        return 1
    if ranks <= 1:
        return 0
    if kind is Kind.ALL_REDUCE:
        return 2 * (ranks - 1)
    if kind is Kind.BROADCAST:
        return 1
    return ranks - 1


def path_of(ranks: Sequence[int], vendors: Sequence[str]) -> str:
    """NATIVE when every one of ``ranks`` is of one vendor, else BRIDGE."""
    return NATIVE if len({vendors[r] for r in ranks}) == 1 else BRIDGE


class Piece(NamedTuple):
    """The run [start, stop) of a message's positions (message_cut: its elements viewed flat,
    or under sequence parallelism its tokens) that one sending TP rank sends to one receiving
    TP rank (indices in their stages' TP groups)."""

    sender: int
    receiver: int
    start: int
    stop: int


def runs(numel: int, ranks: int) -> list[tuple[int, int]]:
    """Each TP rank's run [start, stop) of a message of ``numel`` elements: equal runs where
    ``numel`` divides among ``ranks``, else one whole run (rank 0's)."""
    if numel % ranks:
        return [(0, numel)]
    size = numel // ranks
    return [(i * size, (i + 1) * size) for i in range(ranks)]


def shard_degrees(numel: int, tp_sender: int, tp_receiver: int) -> tuple[int, int]:
    """How many runs each end of a boundary cuts a message of ``numel`` elements in (runs): its
    TP degree, or 1 where the message does not divide among its ranks."""
    return len(runs(numel, tp_sender)), len(runs(numel, tp_receiver))


def shard_pieces(numel: int, senders: int, receivers: int) -> list[Piece]:
    """The pieces a message of ``numel`` elements goes in from a stage of ``senders`` TP ranks
    to one of ``receivers`` (runtime.p2p), in the order each receiver takes them: each
    sender's run, split where it overlaps a receiver's. Where the receiving stage cannot cut
    the message, each of its ranks wants it whole."""
    sent = runs(numel, senders)
    wanted = runs(numel, receivers)
    if len(wanted) < receivers:  # uncut: every receiving rank wants the whole message
        wanted = wanted * receivers
    pieces = []
    for j, (want_start, want_stop) in enumerate(wanted):
        for i, (start, stop) in enumerate(sent):
            low, high = max(start, want_start), min(stop, want_stop)
            if low < high:
                pieces.append(Piece(i, j, low, high))
    return pieces


# --- the pipeline's messages ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Post:
    """One message a stage posts, in its order: a send to or a receive from ``peer`` (a stage of
    the same pipeline) of ``message`` (what it carries: kind, model chunk, micro-batch), over
    ``link``: the ordered pair of stages whose process group carries it (a boundary's
    activations and their gradients share one; ZBV's way back has its own, as
    process_groups.rank_groups gives it)."""

    sends: bool
    peer: int
    message: tuple[str, int, int]
    link: tuple[int, int] = (0, 0)


def stage_posts(orders: Sequence[Sequence[tuple[int, int, int]]], model_chunks) -> list[list[Post]]:
    """The sends and receives of each stage of a pipeline, in the order it posts them, from its
    (kind, chunk, micro-batch) order: a forward of model chunk g receives g - 1's activation and
    sends its own on to g + 1's stage; a backward receives g + 1's gradient and sends its own
    back to g - 1's. A neighbour chunk on the same stage (ZBV's turn) sends nothing."""
    holder = {g: s for s, chunks in enumerate(model_chunks) for g in chunks}
    last = len(holder) - 1
    posts: list[list[Post]] = []
    for s, order in enumerate(orders):
        mine: list[Post] = []
        for kind, chunk, j in order:
            g = model_chunks[s][chunk]
            if kind == FORWARD:
                steps = ((g - 1, False, g - 1), (g + 1, True, g))
                label = "activation"
            elif kind == BACKWARD:
                steps = ((g + 1, False, g + 1), (g - 1, True, g))
                label = "gradient"
            else:
                continue
            for neighbour, sends, source in steps:
                if 0 <= neighbour <= last and holder[neighbour] != s:
                    low = min(g, neighbour)  # the boundary between model chunks low and low + 1
                    link = (holder[low], holder[low + 1])
                    mine.append(Post(sends, holder[neighbour], (label, source, j), link))
        posts.append(mine)
    return posts


# --- a step's transfers ---------------------------------------------------------------------


class Phase(enum.StrEnum):
    """The operation a transfer follows."""

    FORWARD = "forward"  # an activation to the next stage
    BACKWARD = "backward"  # its gradient back
    GRAD_SYNC = "grad-sync"  # a bucket summed among the peers, or gathered in the TP group
    GRAD_EXCHANGE = "grad-exchange"  # summed by the leaders of every stage holding it, and
    # broadcast back in the TP group: it waits for every holder's backwards
    PARAM_GATHER = "param-gather"  # a sharded optimizer's updated weights gathered
    GRAD_NORM = "grad-norm"  # the global gradient norm's sum


@dataclass(frozen=True, slots=True)
class Transfer:
    """One message end or collective a rank takes part in during a step."""

    kind: Kind
    ranks: tuple[int, ...]
    """The collective's group (global ranks, in its order), or a message's (sender, receiver)."""
    nbytes: int
    """The tensor this rank passes (an all-gather's piece, a reduce-scatter's input)."""
    path: str
    phase: Phase

    @property
    def moved(self) -> int:
        """What this rank moves in it (moved_bytes)."""
        return moved_bytes(self.kind, self.nbytes, len(self.ranks))


def message_elements(micro_batch: int, model: ModelSpec) -> int:
    """The elements of one micro-batch's message between two stages, whole: an activation
    (B, T, h), which a stage's TP ranks send in runs (message_cut), or its gradient back."""
    return micro_batch * model.seq_len * model.hidden


class MessageCut(NamedTuple):
    """How a message between two stages is cut among their TP ranks (shard_pieces over its
    ``positions``, each of ``elements`` elements), and whether the receiving stage all-gathers
    its ranks' runs."""

    positions: int
    elements: int
    gathered: bool

    @property
    def numel(self) -> int:
        return self.positions * self.elements


def message_cut(micro_batch: int, model: ModelSpec, sequence_parallel: bool) -> MessageCut:
    """The cut of one micro-batch's message (message_elements) between two stages, as the
    runtime sends it (runtime.p2p) and this list and both pricings count it. Without sequence
    parallelism a stage's every TP rank holds the message whole: it is cut flat, each rank
    sending its run of the elements, and the receiving stage all-gathers the runs. Under
    sequence parallelism each TP rank holds its own tokens, (B, T/t, h), and a stage's input
    and output are that shard (Megatron-LM's): the message is cut by tokens, each rank sending
    the tokens it holds to the receiving ranks that hold them (at unlike TP degrees the shards
    re-cut; a stage of TP 1 holds every token), and nothing is gathered."""
    if sequence_parallel:
        return MessageCut(model.seq_len, micro_batch * model.hidden, gathered=False)
    return MessageCut(message_elements(micro_batch, model), 1, gathered=True)


@memoized
def layout_posts(
    schedule: Schedule, stages: int, chunks: int, micro_batches: int
) -> tuple[tuple[Post, ...], ...]:
    """Every stage's posts (stage_posts) of a pipeline layout, made once per layout shape."""
    orders = [chunk_sequence(schedule, s, stages, chunks, micro_batches) for s in range(stages)]
    posts = stage_posts(orders, stage_model_chunks(schedule, stages, chunks))
    return tuple(tuple(mine) for mine in posts)


@memoized
def _stage_buckets(
    topology: Topology, model: ModelSpec, pipeline: int, stage: int, grouped: bool, cap: int
) -> tuple[SyncBucket, ...]:
    """spec.buckets.rank_buckets of every rank of stage ``stage`` of layout ``pipeline``: its
    TP ranks and replicas hold the same parameters, with the same holders and peers' stages
    (``grouped``: the peers have a group), so one rank's answer is all of theirs."""
    first = next(r.rank for r in topology.ranks if (r.pipeline, r.stage) == (pipeline, stage))
    return rank_buckets(topology, model, first, peers_have_a_group=grouped, cap=cap)


def rank_transfers(
    plan: Plan,
    topology: Topology,
    model: ModelSpec,
    vendors: Sequence[str],
    rank: int,
    *,
    grad_norm: bool,
    cap: int = BUCKET_BYTES,
) -> list[Transfer]:
    """Every transfer ``rank`` takes part in during one training step of ``plan`` (``vendors``:
    each rank's; ``grad_norm``: the step sums the global gradient norm, as ``hethub train``'s
    always do; ``cap``: the buckets' size), as the runtime runs them:

    - the pipeline's messages, in the stage's schedule order (stage_posts): each TP rank sends
      its run of an activation or gradient to the ranks of the next (previous) stage whose runs
      overlap it (shard_pieces, runtime.p2p), and the receiving stage all-gathers the runs;
      under sequence parallelism the runs are the ranks' tokens, kept, not gathered
      (message_cut);
    - the gradient sync, bucket by bucket (spec.buckets, runtime.grad_sync): a direct bucket
      summed among the data-parallel peers in one collective (a reduce-scatter of the padded
      bucket for a sharded optimizer, else an all-reduce); any other summed in its classes
      (spec.slices.sync_classes), each rank its share with one TP rank of every other holder
      stage: one all-reduce inside a vendor; across vendors reduce-scattered inside each
      vendor, each slice all-reduced among its owners over the bridge and all-gathered back;
    - a sharded optimizer's all-gather of each bucket's updated weights, in the compute dtype;
    - the global gradient norm's all-reduce of one fp32 number over the world."""
    done = _pipeline_transfers(plan, topology, model, vendors, rank)
    done += _sync_transfers(plan, topology, model, vendors, rank, cap)
    if grad_norm and topology.world_size > 1:
        world = _world(topology.world_size)
        path = path_of(world, vendors)
        done.append(Transfer(Kind.ALL_REDUCE, world, FP32_BYTES, path, Phase.GRAD_NORM))
    return done


def _pipeline_transfers(
    plan: Plan, topology: Topology, model: ModelSpec, vendors: Sequence[str], rank: int
) -> list[Transfer]:
    """``rank``'s part in its pipeline's messages of one step, in its stage's schedule order
    (rank_transfers' first part)."""
    me = topology.ranks[rank]
    layout = plan.pipelines[me.pipeline]
    stages = len(layout.stages)
    if stages == 1:
        return []
    tp = topology.tp_group(rank)
    cut = message_cut(plan.micro_batch, model, plan.sequence_parallel)
    element = plan.precision.element_bytes
    posts = layout_posts(layout.schedule, stages, layout.virtual_stages, layout.micro_batches)
    done: list[Transfer] = []
    # a stage posts to at most two neighbours, micro-batch after micro-batch: each post's
    # transfers differ from its neighbour's others' only in their phase
    made: dict[tuple[int, bool, Phase], list[Transfer]] = {}
    for post in posts[me.stage]:
        phase = Phase.FORWARD if post.message[0] == "activation" else Phase.BACKWARD
        key = (post.peer, post.sends, phase)
        if key not in made:
            peers = topology.stage_ranks(me.replica, post.peer)
            made[key] = _post_transfers(
                rank, tp, peers, post.sends, cut=cut, element=element, vendors=vendors, phase=phase
            )
        done += made[key]
    return done


def _sync_transfers(
    plan: Plan, topology: Topology, model: ModelSpec, vendors: Sequence[str], rank: int, cap: int
) -> list[Transfer]:
    """``rank``'s part in its stage's gradient sync, bucket by bucket, and a sharded
    optimizer's gathers (rank_transfers' second part)."""
    me = topology.ranks[rank]
    peers = topology.data_parallel_peers(rank)
    grouped = (plan.shard_optimizer or plan.overlap_grad_sync) and len(peers) > 1
    sharded = plan.shard_optimizer and grouped
    shards = len(peers) if sharded else 1
    table = parameter_table(model)
    grad = MAIN_GRAD_BYTES
    peers_path = path_of(peers, vendors)
    done: list[Transfer] = []
    classes_of: dict[tuple[int, ...], list[_ClassPlace]] = {}
    for bucket in _stage_buckets(topology, model, me.pipeline, me.stage, grouped, cap):
        params = [table[name] for name in bucket.names]
        local = sum(math.prod(param.shard_shape(me.tp)) for param in params)
        padded = local + (-local % shards)
        if bucket.direct and len(peers) > 1:
            if sharded:
                kind, nbytes = Kind.REDUCE_SCATTER, padded * grad
            else:
                kind, nbytes = Kind.ALL_REDUCE, local * grad
            done.append(Transfer(kind, peers, nbytes, peers_path, Phase.GRAD_SYNC))
        elif not bucket.direct:
            if bucket.holders not in classes_of:  # buckets share their holders: once each
                holder_stages = [topology.tp_group(leader) for leader in bucket.holders]
                classes_of[bucket.holders] = [
                    _ClassPlace.of(share, vendors, rank)
                    for share in sync_classes(holder_stages)
                    if rank in share.ranks
                ]
            for place in classes_of[bucket.holders]:
                done += place.transfers(_class_share_elements(place.share, params) * grad)
        if sharded:
            piece = padded // shards * plan.precision.element_bytes
            done.append(Transfer(Kind.ALL_GATHER, peers, piece, peers_path, Phase.PARAM_GATHER))
    return done


def _class_share_elements(share: SyncClass, params) -> int:
    """The elements of ``params`` that one class of a bucket's sum holds: its run of each
    split tensor, every tensor whole on every TP rank whole."""
    return sum(
        math.prod(param.shape) * (share.stop - share.start) // share.units
        if param.tp_dim is not None
        else math.prod(param.shape)
        for param in params
    )


@memoized
def _world(size: int) -> tuple[int, ...]:
    """Every rank, one tuple shared by every rank's transfers (a dry run holds them all)."""
    return tuple(range(size))


def _post_transfers(
    rank: int,
    tp: tuple[int, ...],
    peers: tuple[int, ...],
    sends: bool,
    *,
    cut: MessageCut,
    element: int,
    vendors: Sequence[str],
    phase: Phase,
) -> list[Transfer]:
    """``rank``'s transfers in one post of a message cut as ``cut`` says, of ``element``-byte
    elements, between its stage (``tp``: its TP ranks) and the stage of ``peers``: the sends of
    its run's pieces, or the receipts of its run's and (a flat cut) the stage's all-gather of
    the runs."""
    me = tp.index(rank)
    size = cut.elements * element  # the bytes of one position

    def transfer(kind: Kind, ranks: tuple[int, ...], nbytes: int) -> Transfer:
        return Transfer(kind, ranks, nbytes, path_of(ranks, vendors), phase)

    if sends:
        return [
            transfer(Kind.SEND, (rank, peers[p.receiver]), (p.stop - p.start) * size)
            for p in shard_pieces(cut.positions, len(tp), len(peers))
            if p.sender == me
        ]
    mine = [p for p in shard_pieces(cut.positions, len(peers), len(tp)) if p.receiver == me]
    done = [transfer(Kind.RECV, (peers[p.sender], rank), (p.stop - p.start) * size) for p in mine]
    run = mine[-1].stop - mine[0].start
    if cut.gathered and run < cut.positions:  # the stage all-gathers the runs
        done.append(transfer(Kind.ALL_GATHER, tp, run * size))
    return done


@dataclass(frozen=True, slots=True)
class _ClassPlace:
    """Where one rank stands in one class of a bucket's sum (spec.slices.sync_classes): the
    class's vendor parts and the bridge slices this rank owns, found once for all the buckets
    of a holder set (at scale a class spans hundreds of ranks)."""

    share: SyncClass
    parts: tuple[tuple[int, ...], ...]
    local: tuple[int, ...]
    """This rank's vendor part."""
    cuts: tuple[BridgeSlice, ...]
    """The bridge slices this rank owns (none where the class has one vendor)."""

    @classmethod
    def of(cls, share: SyncClass, vendors: Sequence[str], rank: int) -> _ClassPlace:
        parts = vendor_parts(share.ranks, vendors)
        local = next(part for part in parts if rank in part)
        cuts = () if len(parts) == 1 else bridge_slices(parts)
        return cls(share, parts, local, tuple(cut for cut in cuts if rank in cut.ranks))

    def transfers(self, nbytes: int) -> list[Transfer]:
        """This rank's part in summing its share of a bucket, ``nbytes`` of fp32 elements, with
        the rest of its class (runtime.grad_sync, comm.Communicator.sliced_all_reduce): one
        all-reduce inside a vendor; across vendors a reduce-scatter inside this rank's vendor,
        an all-reduce of each slice it owns over the bridge, an all-gather back."""
        parts, local = self.parts, self.local
        if len(parts) == 1:
            return [Transfer(Kind.ALL_REDUCE, local, nbytes, NATIVE, Phase.GRAD_EXCHANGE)]
        padded = padded_length(nbytes // MAIN_GRAD_BYTES, parts) * MAIN_GRAD_BYTES
        unit = padded // slice_units(parts)
        done = []
        if len(local) > 1:
            done.append(Transfer(Kind.REDUCE_SCATTER, local, padded, NATIVE, Phase.GRAD_EXCHANGE))
        for cut in self.cuts:
            size = (cut.stop - cut.start) * unit
            done.append(Transfer(Kind.ALL_REDUCE, cut.ranks, size, BRIDGE, Phase.GRAD_EXCHANGE))
        if len(local) > 1:
            piece = padded // len(local)
            done.append(Transfer(Kind.ALL_GATHER, local, piece, NATIVE, Phase.GRAD_EXCHANGE))
        return done


def comm_bytes(transfers: Sequence[Transfer]) -> dict[str, int]:
    """What ``transfers`` move on each path: {NATIVE: bytes, BRIDGE: bytes}, as the
    Communicator counts them (comm_bytes in metrics.jsonl)."""
    moved = {NATIVE: 0, BRIDGE: 0}
    for transfer in transfers:
        moved[transfer.path] += transfer.moved
    return moved


@memo_scope()  # every rank of a stage reads the stage's buckets and posts: one Memo
def step_comm_bytes(
    plan: Plan, topology: Topology, model: ModelSpec, vendors: Sequence[str], *, grad_norm: bool
) -> tuple[dict[str, int], dict[str, int]]:
    """One step's bytes on each path over every rank, and the most any one rank moves on each
    (metrics.jsonl's comm_bytes and comm_bytes_busiest_rank)."""
    total = {NATIVE: 0, BRIDGE: 0}
    busiest = {NATIVE: 0, BRIDGE: 0}
    for rank in range(topology.world_size):
        mine = comm_bytes(rank_transfers(plan, topology, model, vendors, rank, grad_norm=grad_norm))
        for path, moved in mine.items():
            total[path] += moved
            busiest[path] = max(busiest[path], moved)
    return total, busiest
