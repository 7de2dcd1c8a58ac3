"""The pipeline's point-to-point traffic (Megatron-core's p2p_communication, its scatter-gather):
a stage's activations to the next stage and their gradients back to the previous one, each TP
rank sending its own share, none of them a leader every byte goes through.

A message is cut along the sequence dimension of its (B, T, h) tensor: TP rank i of a stage of
t ranks holds the sequence slice [i T/t, (i + 1) T/t), which under sequence parallelism is the
shard its layers already run on. Each rank of the sending stage sends its slice, split where it
overlaps the slices of the receiving stage's ranks (``shard_pieces``), so between like TP
degrees rank i sends to rank i only and between unlike ones each receiving rank gets the
pieces it needs from the senders whose slices overlap its own (the shards re-cut, no leader).
The receiving stage then all-gathers its slices inside its TP group to the whole tensor; where
a sequence cannot be cut into a stage's slices (T not a multiple of its TP degree), that end
falls back to one whole piece: only TP rank 0 sends, or every receiving rank receives it all.

Messages go over the world group (gloo), each tagged by its stream, since two ranks may carry
several streams between them in the same direction: the activations of one way and the
gradients of the other (two interleaved stages, each the other's next; ZBV's V, whose chunk 1
flows back from stage s + 1 to s). Each stream's messages go in the order both ends run them,
as each leader pair's groups once kept them apart.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hethub.comm import Communicator, Work
from hethub.runtime.process_groups import RankGroups, runs_a_v
from hethub.spec.topology import Topology

SEQUENCE_DIM = 1
"""The dimension of a (B, T, h) message that its shards cut."""


class Piece(NamedTuple):
    """The part [start, stop) of a message's sequence that one sending TP rank sends to one
    receiving TP rank (indices in their stages' TP groups)."""

    sender: int
    receiver: int
    start: int
    stop: int


def slices(length: int, ranks: int) -> list[tuple[int, int]]:
    """Each TP rank's slice [start, stop) of a sequence of ``length``: equal slices where
    ``length`` divides among ``ranks``, else one whole slice (the rank-0 fall-back)."""
    if length % ranks:
        return [(0, length)]
    size = length // ranks
    return [(i * size, (i + 1) * size) for i in range(ranks)]


def shard_pieces(length: int, senders: int, receivers: int) -> list[Piece]:
    """The pieces a message of sequence ``length`` goes in from a stage of ``senders`` TP ranks
    to one of ``receivers``: each sender's slice, split where it overlaps a receiver's. A
    receiver whose stage cannot cut the sequence wants it whole (each of them)."""
    sent = slices(length, senders)
    wanted = slices(length, receivers)
    if len(wanted) < receivers:  # uncut: every receiving rank wants the whole sequence
        wanted = wanted * receivers
    pieces = []
    for j, (want_start, want_stop) in enumerate(wanted):
        for i, (start, stop) in enumerate(sent):
            lo, hi = max(start, want_start), min(stop, want_stop)
            if lo < hi:
                pieces.append(Piece(i, j, lo, hi))
    return pieces


def stream_tag(forward: bool, returning: bool) -> int:
    """The tag of a stream between two ranks: its direction (activations or gradients) and
    whether it is the V's way back, so that no two streams between two ranks share one."""
    return 2 * returning + forward


class StageLinks:
    """One rank's links to its neighbouring stages' TP ranks."""

    def __init__(
        self, comm: Communicator, groups: RankGroups, device: torch.device, dtype: torch.dtype
    ) -> None:
        """``groups``: this rank's; messages are ``dtype`` tensors on ``device``. ``connect``
        gives it the stages it links (the Pipeline does, from the topology)."""
        self.comm, self.groups, self.device, self.dtype = comm, groups, device, dtype
        self.leads = comm.rank == groups.leader
        self.me = groups.tp.ranks.index(comm.rank)
        """This rank's index in its stage's TP group."""
        self._stages: dict[tuple[bool, bool], tuple[int, ...]] = {}

    def connect(self, topology: Topology, rank: int) -> None:
        """Learn the TP ranks of this rank's neighbouring stages in ``topology``: the next and
        the previous (interleaved: the last stage feeds the first), and ZBV's V's way back."""
        me = topology.ranks[rank]
        stages = topology.replica_stages(me.replica)
        v_shaped = runs_a_v(topology, me.replica)
        wraps = len(me.chunks) > 1 and not v_shaped

        def ranks_of(stage: int) -> tuple[int, ...]:
            return topology.stage_ranks(me.replica, stage % stages)

        for towards_next, step in ((True, 1), (False, -1)):
            neighbour = me.stage + step
            if 0 <= neighbour < stages or (wraps and stages > 1):
                self._stages[(towards_next, False)] = ranks_of(neighbour)
            # the V's way back: its next stage is the one before
            if v_shaped and 0 <= me.stage - step < stages:
                self._stages[(towards_next, True)] = ranks_of(me.stage - step)

    def send(self, tensor: torch.Tensor, forward: bool, returning: bool = False) -> list[Work]:
        """Start sending this rank's share of ``tensor`` (B, T, h), whole on every TP rank of
        the stage, to the next stage (``forward``: an activation) or the previous (its
        gradient): its pieces' sends (wait for them before the step ends). ``returning``: of
        the V's way back (ZBV's chunk 1), whose next stage is the one before."""
        peers = self._stages[(forward, returning)]
        tag = stream_tag(forward, returning)
        works = []
        for piece in shard_pieces(
            tensor.shape[SEQUENCE_DIM], len(self.groups.tp.ranks), len(peers)
        ):
            if piece.sender == self.me:
                part = tensor[:, piece.start : piece.stop].contiguous()
                works.append(self.comm.isend(part, peers[piece.receiver], tag=tag))
        return works

    def receive(
        self, shape: tuple[int, ...], forward: bool, returning: bool = False
    ) -> torch.Tensor:
        """Receive an activation (B, T, h) from the previous stage (``forward``) or a gradient
        from the next, whole on every TP rank of the stage (``returning`` as for ``send``):
        this rank's pieces from the senders, its slice all-gathered in its TP group. The wait
        covers the peers' compute still to come and the transfer: a receive cannot tell them
        apart."""
        peers = self._stages[(not forward, returning)]
        tag = stream_tag(forward, returning)
        tp = self.groups.tp
        pieces = [
            p
            for p in shard_pieces(shape[SEQUENCE_DIM], len(peers), len(tp.ranks))
            if p.receiver == self.me
        ]
        parts = []
        for piece in pieces:
            part_shape = (shape[0], piece.stop - piece.start, *shape[2:])
            buffer = torch.empty(part_shape, device=self.device, dtype=self.dtype)
            parts.append(self.comm.recv(buffer, peers[piece.sender], tag=tag))
        mine = parts[0] if len(parts) == 1 else torch.cat(parts, dim=SEQUENCE_DIM)
        if mine.shape[SEQUENCE_DIM] == shape[SEQUENCE_DIM]:  # uncut: received whole
            return mine
        return self.comm.all_gather(mine, tp, dim=SEQUENCE_DIM)

    def wait(self, sends: list[Work]) -> None:
        """Wait for ``sends`` to complete (within the communicator's timeout)."""
        for work in sends:
            self.comm.wait(work)
