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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hethub.runtime.data import to_device
from hethub.runtime.model import StageChunks
from hethub.runtime.p2p import StageLinks
from hethub.runtime.timeline import StepTimeline
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan
from hethub.spec.schedules import BACKWARD, FORWARD, chunk_sequence
from hethub.spec.topology import Topology


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
        timeline: StepTimeline,
        *,
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
        self.peak_in_flight = 0.0
        """Micro-batches of the whole stage's activations held at once in the last step, at its
        peak (a chunk's forward holds its layers' until its backward): what the predictor's
        memory reads from spec.schedules.in_flight_micro_batches, measured as the step ran."""

    def run(
        self, tokens: torch.Tensor, before_last_backward: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Forward and backward of this replica's share of the global batch ``tokens``
        (sequences, seq_len + 1), leaving each parameter's gradient summed over them; this
        rank's share of the loss (0 off the last stage's leaders), a 0-d fp32 tensor on the
        device, not yet read. ``before_last_backward(c)`` runs just before chunk c's last
        backward of the step (an overlapped gradient sync arms its hooks there)."""
        micro = self._my_micro_batches(tokens)
        total = sum(p.count * p.micro_batches for p in self.plan.pipelines)
        stages = self.topology.replica_stages(self.me.replica)
        shape = (self.plan.micro_batch, self.spec.seq_len, self.spec.hidden)  # (B, T, h)
        chunks = self.me.chunks
        order = chunk_sequence(self.layout.schedule, self.me.stage, stages, len(chunks), len(micro))
        last_backward = {c: i for i, (kind, c, _) in enumerate(order) if kind == BACKWARD}
        inputs, outputs, sends = {}, {}, []
        # An activation's send, by micro-batch: its work holds the tensor until it goes, so it
        # is finished once the gradient comes back (the next stage received the activation
        # before its backward), rather than held with every other to the step's end.
        activation_sends: dict[tuple[int, int], list] = {}
        loss_sum = None  # this rank's share of the loss, summed where the losses are
        held = peak = 0  # layers' activations awaiting their backward
        for i, (kind, c, j) in enumerate(order):
            chunk, key = chunks[c], (c, j)
            if before_last_backward is not None and i == last_backward[c]:
                before_last_backward(c)
            if kind == FORWARD:
                x = micro[j][:, :-1] if chunk.is_first else self._receive(shape, True, j)
                with self.timeline.timed("forward", j, self.stretch):
                    out = self._forward(c, x)
                    if chunk.is_last:
                        loss = self.stage.chunks[c].loss(out, micro[j][:, 1:])
                        # one micro-batch in all: the scale is 1, and two operations (forward
                        # and backward) would multiply by it
                        outputs[key] = loss / total if total > 1 else loss
                if chunk.is_last:
                    if self.links.leads:
                        share = outputs[key].detach()
                        loss_sum = share if loss_sum is None else loss_sum + share
                else:
                    outputs[key] = out
                    activation_sends[key] = self.links.send(out.detach(), forward=True)
                inputs[key] = x
                held += chunk.layers
                peak = max(peak, held)
            else:
                grad = None if chunk.is_last else self._receive(shape, False, j)
                self.links.wait(activation_sends.pop(key, []))  # done: its gradient is here
                with self.timeline.timed("backward", j, self.stretch):
                    outputs[key].backward(grad)
                if not chunk.is_first:
                    sends += self.links.send(inputs[key].grad, forward=False)
                del inputs[key], outputs[key]
                held -= chunk.layers
        self.peak_in_flight = peak / sum(c.layers for c in chunks)
        with self.timeline.timed("send_wait"):
            self.links.wait(sends + [w for ws in activation_sends.values() for w in ws])
        return loss_sum if loss_sum is not None else torch.zeros((), device=self.device)

    def _my_micro_batches(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """This replica's micro-batches, on the device: replicas take consecutive slices of the
        global batch, and this one's goes to the device in one copy."""
        b = self.plan.micro_batch
        per_replica = {r.replica: r.micro_batches for r in self.topology.ranks}
        start = sum(per_replica[r] for r in range(self.me.replica)) * b
        mine = tokens[start : start + self.me.micro_batches * b]  # (micro-batches x B, T + 1)
        return list(to_device(mine, self.device).split(b))

    def _receive(self, shape: tuple[int, ...], forward: bool, micro_batch: int) -> torch.Tensor:
        """An activation (``forward``) or a gradient from a neighbouring stage, the time
        blocked in it recorded as a wait; an activation is a leaf that takes its gradient."""
        with self.timeline.timed("recv_wait", micro_batch):
            received = self.links.receive(shape, forward)
        return received.requires_grad_() if forward else received

    def _forward(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        return self.stage.chunks[chunk](x, recompute=self.recompute)
