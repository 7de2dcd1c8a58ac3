"""The pipeline's point-to-point traffic (Megatron-core's p2p_communication with its
scatter-gather): a stage's activations to the next stage and their gradients back to the
previous one, each TP rank sending its own share, none of them a leader every byte goes through.

A message, whole on every TP rank of the sending stage, is cut flat: viewed as one row of
elements, TP rank i of a stage of t ranks owns the i-th of t equal runs of it
(spec.collectives.shard_pieces). Each sending rank sends the parts of its run that overlap each
receiving rank's, so between like TP degrees rank i sends to rank i only, and between unlike
ones each receiving rank gets its run from the senders whose runs overlap it (the shards re-cut,
no leader). A receiving rank receives straight into its run of the message's buffer, and the
stage all-gathers the runs in place inside its TP group (comm.Communicator.all_gather_into). A
run is a view of one contiguous buffer at both ends, so no piece is copied to be sent or
concatenated once received: the step holds no more than the whole message, as the predictor
prices it. Where a message cannot be cut among a stage's ranks (its size not a multiple of
their number), that end falls back to one whole run: TP rank 0 alone sends it, or every
receiving rank receives all of it.

Under sequence parallelism a TP rank holds its own tokens, (B, T/t, h), and a stage's input and
output are that shard (runtime.model.Stage): the message is cut by tokens (spec.collectives
.message_cut), each sending rank sending the tokens it holds to the receiving ranks that hold
them, and nothing is gathered. Between like TP degrees that is rank i's whole shard to rank i;
between unlike ones (a stage of TP 1 holds every token) the shards re-cut. A piece of several
sequences' tokens (B > 1, unlike degrees) is strided in (B, T, h): it goes through a contiguous
copy of the piece's size.

Each ordered pair of neighbouring stages has a group of its own holding both stages' TP ranks
(RankGroups.pipeline_next and _prev), which carries the sender's activations one way and their
gradients back, each in the order both ends run them; so with two stages interleaved (each the
other's next) activations and gradients never cross, and need no tags. ZBV's V
(spec.schedules.model_chunk) runs a second stream between each two neighbours: chunk 1 flows
from stage s + 1 back to stage s over a pair group of its own (pipeline_return_prev and _next).
A pair group of one vendor runs on its native library; one across vendors on the bridge.
"""

from __future__ import annotations

import torch

from hethub.comm import Communicator, Group, Work
from hethub.runtime.process_groups import RankGroups
from hethub.spec.collectives import shard_pieces


class StageLinks:
    """One rank's links to its neighbouring stages' TP ranks."""

    def __init__(
        self,
        comm: Communicator,
        groups: RankGroups,
        device: torch.device,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
    ) -> None:
        """``groups``: this rank's (its stage's pair groups with its neighbours); messages are
        ``dtype`` tensors on ``device``; ``sequence_parallel``: the plan's (messages are the
        ranks' token shards, cut by tokens)."""
        self.comm, self.groups, self.device, self.dtype = comm, groups, device, dtype
        self.leads = comm.rank == groups.leader
        self.tp = groups.tp
        self.me = groups.tp.ranks.index(comm.rank)
        """This rank's index in its stage's TP group."""
        self.by_tokens = sequence_parallel

    def message_shape(self, batch: int, seq_len: int, hidden: int) -> tuple[int, int, int]:
        """What this rank holds of a message of ``batch`` sequences: (B, T, h), or under
        sequence parallelism its tokens (B, T/t, h)."""
        return (batch, seq_len // self.tp.size if self.by_tokens else seq_len, hidden)

    def send(self, tensor: torch.Tensor, forward: bool, returning: bool = False) -> list[Work]:
        """Start sending this rank's share of ``tensor``, whole on every TP rank of the stage,
        to the next stage (``forward``: an activation) or the previous (its gradient): its
        pieces' sends (wait for them before the step ends; ``tensor`` must not change until
        then). ``returning``: of the V's way back (ZBV's chunk 1), whose next stage is the one
        before."""
        link, peers = self._neighbour(towards_next=forward, returning=returning)
        if self.by_tokens:
            tokens = tensor.shape[1]  # this rank's
            offset = self.me * tokens
            return [
                self.comm.isend(
                    tensor[:, piece.start - offset : piece.stop - offset].contiguous(),
                    peers[piece.receiver],
                    link,
                )
                for piece in shard_pieces(tokens * self.tp.size, self.tp.size, len(peers))
                if piece.sender == self.me
            ]
        flat = tensor.contiguous().view(-1)  # a view where it is contiguous, as it is here
        return [
            self.comm.isend(flat[piece.start : piece.stop], peers[piece.receiver], link)
            for piece in shard_pieces(flat.numel(), self.tp.size, len(peers))
            if piece.sender == self.me
        ]

    def receive(
        self, shape: tuple[int, ...], forward: bool, returning: bool = False
    ) -> torch.Tensor:
        """Receive an activation from the previous stage (``forward``) or a gradient from the
        next, whole on every TP rank of the stage (``returning`` as for ``send``): this rank's
        run from the senders, then the stage's all-gather of the runs. The wait covers the
        peers' compute still to come and the transfer: a receive cannot tell them apart."""
        link, peers = self._neighbour(towards_next=not forward, returning=returning)
        buffer = torch.empty(shape, device=self.device, dtype=self.dtype)
        if self.by_tokens:
            tokens = shape[1]  # this rank's
            offset = self.me * tokens
            for piece in shard_pieces(tokens * self.tp.size, len(peers), self.tp.size):
                if piece.receiver != self.me:
                    continue
                part = buffer[:, piece.start - offset : piece.stop - offset]
                if part.is_contiguous():
                    self.comm.recv(part, peers[piece.sender], link)
                else:  # several sequences' tokens: strided in the shard
                    landed = torch.empty(part.shape, device=self.device, dtype=self.dtype)
                    self.comm.recv(landed, peers[piece.sender], link)
                    part.copy_(landed)
            return buffer
        flat = buffer.view(-1)
        mine = [
            piece
            for piece in shard_pieces(flat.numel(), len(peers), self.tp.size)
            if piece.receiver == self.me
        ]
        for piece in mine:
            self.comm.recv(flat[piece.start : piece.stop], peers[piece.sender], link)
        start, stop = mine[0].start, mine[-1].stop
        if stop - start < flat.numel():  # cut among the stage: gather the other runs
            self.comm.all_gather_into(flat, flat[start:stop], self.tp)
        return buffer

    def wait(self, sends: list[Work]) -> None:
        """Wait for ``sends`` to complete (within the communicator's timeout)."""
        for work in sends:
            self.comm.wait(work)

    def _neighbour(self, towards_next: bool, returning: bool) -> tuple[Group, tuple[int, ...]]:
        """The pair's group with the next stage, or the previous one, and that stage's TP
        ranks; ``returning``: on the V's way back, whose next stage is the one before. A pair
        group lists the sending stage's ranks, then the receiving one's."""
        groups, own = self.groups, self.tp.size
        if returning:
            if towards_next:
                link = groups.pipeline_return_next  # (this stage, the stage before)
                return link, link.ranks[own:]
            link = groups.pipeline_return_prev  # (the stage after, this stage)
            return link, link.ranks[: link.size - own]
        if towards_next:
            link = groups.pipeline_next  # (this stage, the next)
            return link, link.ranks[own:]
        link = groups.pipeline_prev  # (the previous stage, this stage)
        return link, link.ranks[: link.size - own]
