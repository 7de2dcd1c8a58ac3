"""The vocabulary of pricing one pipeline stage: where it sits in its pipeline, the times one
micro-batch costs it and its boundary to the next stage, and its gradient sync's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hethub.spec.hashing import hashed_once
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Precision, Recompute


@dataclass(frozen=True, slots=True)
@hashed_once()
class StagePosition:
    """What a stage holds besides its layers, which depends only on where it sits."""

    first: bool
    """It holds the embedding."""
    last: bool
    """It holds the head and computes the loss."""
    alone: bool
    """It is its pipeline's only stage (a tied head then needs no copy of the embedding)."""

    @staticmethod
    def of(index: int, stages: int) -> StagePosition:
        """The position of stage ``index`` (0-based) of ``stages``: one shared instance each, as
        positions key the predictor's caches."""
        return _POSITIONS[(index == 0, index == stages - 1, stages == 1)]


_POSITIONS = {
    (first, last, alone): StagePosition(first=first, last=last, alone=alone)
    for first in (False, True)
    for last in (False, True)
    for alone in (False, True)
}
MIDDLE = StagePosition.of(1, 3)
"""A stage with layers alone: what one more layer costs any stage."""


class LayerShape(NamedTuple):
    """What one transformer layer's costs depend on besides its device: a key of the caches of
    compute.layer_cost and memory.layer_activation_bytes."""

    model: ModelSpec
    tp: int
    micro_batch: int
    recompute: Recompute
    precision: Precision
    sequence_parallel: bool = False
    """The layer runs sequence-parallel (the plan asks for it and tp > 1)."""


class StageShape(NamedTuple):
    """What a stage's (or one of its chunks') costs depend on besides its devices (a tuple:
    made for every stage of every prediction, and a key of the caches of the pricing and the
    memory model, which take it whole)."""

    model: ModelSpec
    layers: int
    tp: int
    position: StagePosition
    micro_batch: int
    recompute: Recompute
    precision: Precision
    sequence_parallel: bool = False
    """The plan's sequence parallelism, which a stage runs where tp > 1."""

    @property
    def split_sequence(self) -> bool:
        """This stage runs sequence-parallel: the plan asks for it and tp > 1."""
        return self.sequence_parallel and self.tp > 1

    @property
    def layer(self) -> LayerShape:
        """One of its layers' shape."""
        return LayerShape(
            self.model,
            self.tp,
            self.micro_batch,
            self.recompute,
            self.precision,
            self.split_sequence,
        )


class StageTimes(NamedTuple):
    """Seconds one micro-batch takes through a stage."""

    forward_s: float
    backward_s: float
    """Recomputation included."""


class SendTimes(NamedTuple):
    """Seconds one micro-batch's tensors take over the boundary between two stages."""

    forward_s: float
    """The activation, to the next stage."""
    backward_s: float
    """Its gradient, back."""


class SyncTimes(NamedTuple):
    """A stage's gradient sync on one rank, in the two parts the step puts apart."""

    reduce_s: float
    """The gradients' sum (all-reduce, or a sharded optimizer's reduce-scatter): before the
    optimizer step, and what an overlapped sync can hide behind the backwards."""
    gather_s: float
    """A sharded optimizer's all-gather of the updated weights: after its step."""
    exchange_s: float = 0.0
    """Of ``reduce_s``, the exchange between unlike layouts (through the stage leaders, over
    the bridge where the vendors differ): it waits for every layout's stages, so an overlapped
    sync leaves it after the last backward, where it hides the rest."""
