"""The pipeline's point-to-point traffic (Megatron-core's p2p_communication): a stage's
activations to the next stage and their gradients back to the previous one.

Activations and their gradients are whole on every TP rank of a stage, so the two stages'
leaders exchange them (whatever the two stages' TP degrees) and the receiving leader broadcasts
to its TP group. Each ordered pair of neighbouring leaders has a group of its own, which carries
the sender's activations one way and their gradients back, each in the order both ends run them;
so with two stages interleaved (the previous and the next stage one rank) activations and
gradients never cross, and need no tags.

ZBV's V (spec.schedules.model_chunk) runs a second stream between each two neighbours: chunk 1
flows from stage s + 1 back to stage s, so its activations go the other way ("returning"),
over a pair group of their own (RankGroups.pipeline_return_prev and _next), which carries them
and their gradients as the first pair carries chunk 0's. Each pair then carries one chunk's
activations one way and their gradients the other, each in the order of that chunk's forwards
(backwards), the same at both ends.
"""

from __future__ import annotations

import torch

from hethub.comm import Communicator, Group, Work
from hethub.runtime.process_groups import RankGroups


class StageLinks:
    """One rank's links to its neighbouring stages."""

    def __init__(
        self, comm: Communicator, groups: RankGroups, device: torch.device, dtype: torch.dtype
    ) -> None:
        """``groups``: this rank's (its pipeline pairs on a leader); messages are ``dtype``
        tensors on ``device``."""
        self.comm, self.groups, self.device, self.dtype = comm, groups, device, dtype
        self.leads = comm.rank == groups.leader

    def send(self, tensor: torch.Tensor, forward: bool, returning: bool = False) -> list[Work]:
        """Start sending an activation to the next stage (``forward``) or its gradient to the
        previous: the leader's send (wait for it before the step ends), none elsewhere.
        ``returning``: of the V's way back (ZBV's chunk 1), whose next stage is the one
        before."""
        if not self.leads:
            return []
        link, peer = self._neighbour(towards_next=forward, returning=returning)
        return [self.comm.isend(tensor.contiguous(), peer, link)]

    def receive(
        self, shape: tuple[int, ...], forward: bool, returning: bool = False
    ) -> torch.Tensor:
        """Receive an activation from the previous stage (``forward``) or a gradient from the
        next, on every TP rank of the stage (``returning`` as for ``send``). The wait covers
        the peer's compute still to come and the transfer: a receive cannot tell them apart."""
        buffer = torch.empty(shape, device=self.device, dtype=self.dtype)
        if self.leads:
            link, peer = self._neighbour(towards_next=not forward, returning=returning)
            self.comm.recv(buffer, peer, link)
        self.comm.broadcast(buffer, self.groups.leader, self.groups.tp)
        return buffer

    def wait(self, sends: list[Work]) -> None:
        """Wait for ``sends`` to complete (within the communicator's timeout)."""
        for work in sends:
            self.comm.wait(work)

    def _neighbour(self, towards_next: bool, returning: bool) -> tuple[Group, int]:
        """The pair's group with the next stage's leader, or the previous one's, and that
        leader; ``returning``: on the V's way back, whose next stage is the one before."""
        if returning:
            if towards_next:
                link = self.groups.pipeline_return_next  # (this rank, the stage before's leader)
                return link, link.ranks[1]
            link = self.groups.pipeline_return_prev  # (the stage after's leader, this rank)
            return link, link.ranks[0]
        if towards_next:
            link = self.groups.pipeline_next  # (this rank, the next leader)
            return link, link.ranks[1]
        link = self.groups.pipeline_prev  # (the previous leader, this rank)
        return link, link.ranks[0]
