"""One rank's part of the pipeline schedule (Megatron-core's schedules): each forward and
backward of its micro-batches through its model chunks, in the order spec.schedules gives
(the order the predictor simulates), with the sends and receives between stages (runtime.p2p).

Exactness by construction: every micro-batch's loss is scaled by 1 / (micro-batches in the global
batch), so summing gradients over micro-batches and replicas gives the gradient of the mean
token loss over the global batch, whatever the split between unlike replicas.

The host never waits for the device inside the schedule: the step's tokens go to the device in
one copy that does not block, and the loss is summed on the device, for the engine to read once,
when the step is over.

A group with an emulated ``speed`` (a fraction of this machine's speed, for local runs) has every
forward and backward stretched by sleeping (1 / speed - 1) times its measured duration.

Evaluation (``evaluate``) is forward only, whatever the training schedule (1F1B, interleaved,
ZBV): each replica takes a contiguous share of the windows' micro-batches (in proportion to its
share of a training step's), and each stage runs them one after another, each through its chunks
in the model's order, receiving, computing and sending as it goes. Every rank follows the same
(micro-batch, model chunk) order, and every message is awaited only after those before it, so
the stages never wait on each other in a circle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hethub.runtime.data import to_device
from hethub.runtime.model import StageChunks
from hethub.runtime.p2p import StageLinks
from hethub.runtime.split_backward import WeightPass, input_backward
from hethub.runtime.timeline import StepTimeline
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan
from hethub.spec.schedules import BACKWARD, FORWARD, WEIGHT, Schedule, chunk_sequence
from hethub.spec.topology import Topology


@dataclass(slots=True)
class _InFlightTensors:
    """What one step's schedule holds between its operations, by (chunk, micro-batch)."""

    shape: tuple[int, ...]
    """A message between stages: (B, T, h)."""
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """A chunk's input (a received activation takes its gradient) until its backward."""
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """A chunk's output (its loss on the last chunk) until its backward."""
    weight_passes: dict[tuple[int, int], WeightPass] = field(default_factory=dict)
    """Zero-bubble: what a backward kept for its WEIGHT."""
    activation_sends: dict[tuple[int, int], list] = field(default_factory=dict)
    """An activation's send: its work holds the tensor until it goes, so it is finished once
    the gradient comes back (the next stage received the activation before its backward),
    rather than held with every other to the step's end."""
    sends: list = field(default_factory=list)
    """The gradients' sends, finished at the step's end."""
    turning: dict[int, torch.Tensor] = field(default_factory=dict)
    """The V's turn, by micro-batch: the last stage's chunk 0 output, chunk 1's input."""
    turned_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """The V's turn back: chunk 1's input gradient, chunk 0's output gradient."""
    loss_sum: torch.Tensor | None = None
    """This rank's share of the loss, summed where the losses are."""


class Pipeline:
    """Runs this rank's stage through one global batch's schedule."""

    def __init__(
        self,
        plan: Plan,
        topology: Topology,
        spec: ModelSpec,
        rank: int,
        stage: StageChunks,
        links: StageLinks,
        *,
        timeline: StepTimeline,
        device: torch.device,
        speed: float | None = None,
    ) -> None:
        """``stage``: this rank's model chunks, on ``device``; ``speed``: this rank's emulated
        speed relative to the machine (None: as fast as it runs)."""
        self.plan, self.topology, self.spec, self.device = plan, topology, spec, device
        self.me = topology.ranks[rank]
        self.layout = plan.pipelines[self.me.pipeline]
        self.recompute = self.layout.stages[self.me.stage].recompute
        self.stage, self.links, self.timeline = stage, links, timeline
        self.stretch = 1.0 / speed - 1.0 if speed else 0.0
        self.stages = topology.replica_stages(self.me.replica)
        self.v_shaped = self.layout.schedule == Schedule.ZBV
        """Chunk 1 flows back from the last stage to the first (spec.schedules.model_chunk)."""
        # Per chunk, the weights a zero-bubble WEIGHT gives gradients (split_backward).
        self._weights = [list(chunk.parameters()) for chunk in stage.chunks]

    def run(
        self, tokens: torch.Tensor, before_last_backward: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Forward and backward of this replica's share of the global batch ``tokens``
        (sequences, seq_len + 1), leaving each parameter's gradient summed over them; this
        rank's share of the loss (0 off the last stage's leaders), a 0-d fp32 tensor on the
        device, not yet read. ``before_last_backward(c)`` runs just before chunk c's last
        operation of the step that gives its weights gradients (its last backward; under a
        zero-bubble schedule its last WEIGHT): an overlapped gradient sync arms its hooks
        there."""
        micro = self._my_micro_batches(tokens)
        total = sum(p.count * p.micro_batches for p in self.plan.pipelines)
        shape = self.links.message_shape(self.plan.micro_batch, self.spec.seq_len, self.spec.hidden)
        chunks, schedule = self.me.chunks, self.layout.schedule
        order = chunk_sequence(schedule, self.me.stage, self.stages, len(chunks), len(micro))
        # the operation that gives a chunk's weights their gradients and frees its activations
        gives_weights = WEIGHT if schedule.splits_backward else BACKWARD
        last_gradients = {c: i for i, (kind, c, _) in enumerate(order) if kind == gives_weights}
        step = _InFlightTensors(shape)
        for i, (kind, c, j) in enumerate(order):
            if before_last_backward is not None and i == last_gradients[c]:
                before_last_backward(c)
            if kind == FORWARD:
                self._forward_op(step, c, j, micro, total)
            elif kind == BACKWARD:
                self._backward_op(step, c, j)
            else:
                with self.timeline.timed("backward", j, self.stretch):
                    step.weight_passes.pop((c, j)).run()
        with self.timeline.timed("send_wait"):
            waits = [w for ws in step.activation_sends.values() for w in ws]
            self.links.wait(step.sends + waits)
        return step.loss_sum if step.loss_sum is not None else torch.zeros((), device=self.device)

    def _forward_op(
        self, step: _InFlightTensors, c: int, j: int, micro: list[torch.Tensor], total: int
    ) -> None:
        """Chunk c's forward of micro-batch j: its input received (tokens on the first chunk;
        the V's turn on the last stage, chunk 0's output, here), its output sent on or its loss
        kept."""
        chunk, key = self.me.chunks[c], (c, j)
        if chunk.is_first:
            x = micro[j][:, :-1]
        elif self._turns(c):  # the V's turn: chunk 0's output, here
            x = step.turning.pop(j)
        else:
            x = self._receive(step.shape, True, j, self._returning(c))
        with self.timeline.timed("forward", j, self.stretch):
            out = self._forward(c, x)
            if chunk.is_last:
                # The logits (out) go with this call: the loss keeps what its backward reads
                # (F.cross_entropy its log-softmax, the vocabulary-parallel loss the logits),
                # as predictor.memory._LastStageMoments prices it.
                loss = self.stage.chunks[c].loss(out, micro[j][:, 1:])
                # one micro-batch in all: the scale is 1, and two operations (forward and
                # backward) would multiply by it
                step.outputs[key] = loss / total if total > 1 else loss
        if chunk.is_last:
            if self.links.leads:
                share = step.outputs[key].detach()
                step.loss_sum = share if step.loss_sum is None else step.loss_sum + share
        else:
            step.outputs[key] = out
            if self._hands_over(c):
                step.turning[j] = out.detach().requires_grad_()
            else:
                step.activation_sends[key] = self.links.send(
                    out.detach(), forward=True, returning=self._returning(c)
                )
        step.inputs[key] = x

    def _backward_op(self, step: _InFlightTensors, c: int, j: int) -> None:
        """Chunk c's backward of micro-batch j (under a zero-bubble schedule its input's
        gradient only, its weights' kept for its WEIGHT), the input's gradient sent back."""
        chunk, key = self.me.chunks[c], (c, j)
        returning = self._returning(c)
        if chunk.is_last:
            grad = None
        elif self._hands_over(c):  # the V's turn: chunk 1's input gradient, here
            grad = step.turned_grads.pop(j)
        else:
            grad = self._receive(step.shape, False, j, returning)
        self.links.wait(step.activation_sends.pop(key, []))  # done: its gradient is here
        x = None if chunk.is_first else step.inputs[key]
        with self.timeline.timed("backward", j, self.stretch):
            if self.layout.schedule.splits_backward:
                weights = self._weights[c]
                step.weight_passes[key] = input_backward(step.outputs[key], grad, x, weights)
            else:
                step.outputs[key].backward(grad)
        if x is not None:
            if self._turns(c):
                step.turned_grads[j] = x.grad
            else:
                step.sends += self.links.send(x.grad, forward=False, returning=returning)
        del step.inputs[key], step.outputs[key]

    def evaluate(self, tokens: torch.Tensor) -> torch.Tensor:
        """Forward only, under torch.no_grad, of this replica's share of the windows ``tokens``
        (n, seq_len + 1) in micro-batches of the plan's size (the last may be smaller); this
        rank's sum of the token losses (0 off the last stage's leaders), a 0-d fp32 tensor on
        the device, not read."""
        b, t = self.plan.micro_batch, self.spec.seq_len
        start, stop = self._eval_share(tokens.shape[0])
        mine = to_device(tokens[start:stop], self.device)  # (sequences, T + 1)
        chunks = sorted(range(len(self.me.chunks)), key=lambda c: self.me.chunks[c].index)
        total = torch.zeros((), device=self.device)
        sends: list = []  # the last micro-batch's, awaited once the next one is done
        turning: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for j, micro in enumerate(mine.split(b)):
                shape = self.links.message_shape(micro.shape[0], t, self.spec.hidden)
                earlier, sends = sends, []
                for c in chunks:
                    chunk = self.me.chunks[c]
                    if chunk.is_first:
                        x = micro[:, :-1]
                    elif self._turns(c):
                        x = turning.pop(j)
                    else:
                        x = self.links.receive(shape, True, self._returning(c))
                    out = self.stage.chunks[c](x)
                    if chunk.is_last:  # every TP rank (the loss is a TP collective)
                        loss = self.stage.chunks[c].loss(out, micro[:, 1:])
                        if self.links.leads:  # the mean over its tokens, as a sum
                            total += loss.float() * micro[:, 1:].numel()
                    elif self._hands_over(c):
                        turning[j] = out
                    else:
                        sends += self.links.send(out, forward=True, returning=self._returning(c))
                self.links.wait(earlier)  # holds one micro-batch's activations in flight, not all
        self.links.wait(sends)
        return total

    def _eval_share(self, sequences: int) -> tuple[int, int]:
        """The windows [start, stop) of ``sequences`` this replica evaluates: a contiguous share
        of whole micro-batches, in proportion to its micro-batches of a training step."""
        b = self.plan.micro_batch
        micro_batches = -(-sequences // b)
        weights = {r.replica: r.micro_batches for r in self.topology.ranks}
        before = sum(weights[r] for r in range(self.me.replica))
        whole = sum(weights.values())
        first = micro_batches * before // whole
        last = micro_batches * (before + weights[self.me.replica]) // whole
        return min(first * b, sequences), min(last * b, sequences)

    def _returning(self, c: int) -> bool:
        """Whether chunk c flows back along the V (ZBV's chunk 1: from stage s + 1 to s)."""
        return self.v_shaped and c == 1

    def _turns(self, c: int) -> bool:
        """Whether chunk c's input is this rank's own chunk 0's output: the V's turn, on the
        last stage (chunk 1)."""
        return self.v_shaped and c == 1 and self.me.stage == self.stages - 1

    def _hands_over(self, c: int) -> bool:
        """Whether chunk c's output is this rank's own chunk 1's input: the V's turn, on the
        last stage (chunk 0)."""
        return self.v_shaped and c == 0 and self.me.stage == self.stages - 1

    def _my_micro_batches(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """This replica's micro-batches, on the device: replicas take consecutive slices of the
        global batch, and this one's goes to the device in one copy."""
        b = self.plan.micro_batch
        per_replica = {r.replica: r.micro_batches for r in self.topology.ranks}
        start = sum(per_replica[r] for r in range(self.me.replica)) * b
        mine = tokens[start : start + self.me.micro_batches * b]  # (micro-batches x B, T + 1)
        return list(to_device(mine, self.device).split(b))

    def _receive(
        self, shape: tuple[int, ...], forward: bool, micro_batch: int, returning: bool = False
    ) -> torch.Tensor:
        """An activation (``forward``) or a gradient from a neighbouring stage (``returning``:
        along the V's way back), the time blocked in it recorded as a wait; an activation is a
        leaf that takes its gradient."""
        with self.timeline.timed("recv_wait", micro_batch):
            received = self.links.receive(shape, forward, returning)
        return received.requires_grad_() if forward else received

    def _forward(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        return self.stage.chunks[chunk](x, recompute=self.recompute)
