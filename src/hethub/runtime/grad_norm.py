"""The global norm of the gradients, exactly over every TP, pipeline and data-parallel rank and
every vendor, for clipping (torch.nn.utils.clip_grad_norm_ over the whole model).

After the gradient sync every holder of a parameter has the same sum (spec.topology's
parameter_holders: every replica, and GPT's tied head copy); each rank then counts the squares
of the gradient elements that no other rank counts, and one all-reduce of a scalar over the
world adds them up. Which rank counts what is a pure function of the topology (``counted_spans``),
worked out once:

- a parameter held by several stages is counted on one of them, its first holder's (the lowest
  rank among the stage leaders holding it), whatever layout or TP degree the others have (a
  replica on another vendor may split it otherwise);
- on that stage, a TP-split parameter is counted on every TP rank (each holds its own slice),
  one whole on every TP rank (a norm, a row-parallel bias) on TP rank 0 alone;
- under a sharded optimizer the first holder's data-parallel peers each hold the sum of 1/d of
  each bucket, and each counts its shard (its part of the counted parameters).

The squares are summed on the device, and the clip factor min(1, clip / (norm + 1e-6)) is
applied there too: nothing makes the host wait for the device inside a step.
"""

from __future__ import annotations

import torch
from torch.nn.utils import get_total_norm

from hethub.comm import Communicator, Group
from hethub.runtime.flat_layout import FlatLayout
from hethub.runtime.torch_support import foreach_mul_
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import parameter_table
from hethub.spec.topology import Topology, parameter_holders

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does."""


def counted_spans(
    topology: Topology,
    model: ModelSpec,
    rank: int,
    layout: FlatLayout,
    shard: int | None = None,
) -> list[tuple[int, int]]:
    """The (start, stop) spans of ``rank``'s flat buffers (laid out by ``layout``) whose
    gradients it counts in the global norm (see the module's docstring), in buffer order, one
    per parameter (or its part in this rank's shard): a norm per parameter, then the norm of
    those, as torch's clip_grad_norm_ sums them (one norm of a whole buffer of millions of
    fp32 squares came out 7e-6 off here). ``shard``: under a sharded optimizer, this rank's
    index among its data-parallel peers (its part of each bucket); None: it holds every sum
    whole."""
    me = topology.ranks[rank]
    leader = topology.stage_ranks(me.replica, me.stage)[0]
    holders, table = parameter_holders(topology, model), parameter_table(model)

    def counts(name: str) -> bool:
        if table[name].tp_dim is None and me.tp_rank != 0:
            return False
        first = holders[name][0]
        if shard is None:
            return first == leader
        holder = topology.ranks[first]
        return (holder.layout_class, holder.stage) == (me.layout_class, me.stage)

    spans = sorted(layout.spans[name] for name in layout.shapes if counts(name))
    if shard is not None:
        spans = _within_shards(spans, [layout.shard(b, shard) for b in range(len(layout.buckets))])
    return spans


def _within_shards(
    spans: list[tuple[int, int]], shards: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The parts of ``spans`` inside the ``shards`` (both sorted, the shards disjoint)."""
    parts = []
    for start, stop in spans:
        for low, high in shards:
            if start < high and low < stop:
                parts.append((max(start, low), min(stop, high)))
    return sorted(parts)


class GlobalGradNorm:
    """One rank's part of the global gradient norm: its counted gradients (views of its main
    gradients), summed with every other rank's in one all-reduce."""

    def __init__(
        self,
        counted: list[torch.Tensor],
        device: torch.device,
        comm: Communicator,
        world: Group,
    ) -> None:
        self.counted, self.device, self.comm, self.world = counted, device, comm, world

    def compute(self) -> torch.Tensor:
        """Collective over the world, after the gradient sync: the global 2-norm, an fp32 0-d
        tensor on the device, not read."""
        if self.counted:
            squares = get_total_norm(self.counted, 2.0).float().square().reshape(1)
        else:
            squares = torch.zeros(1, device=self.device)
        self.comm.all_reduce(squares, self.world)
        return squares.sqrt().reshape(())


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, clip: float) -> None:
    """Scale ``grads`` by min(1, clip / (norm + CLIP_EPS)) on the device, as
    torch.nn.utils.clip_grad_norm_ does."""
    factor = torch.clamp(clip / (norm + CLIP_EPS), max=1.0)
    with torch.no_grad():
        foreach_mul_(grads, factor)
