"""A chunk's backward split in two, as the zero-bubble schedules run it (Qi et al., ICLR 2024):
B, the input's gradient, which the stage before waits for, and W, the weights' gradients, run
later in a bubble.

B is torch.distributed.pipelining's ``stage_backward_input``: autograd to the chunk's input
alone, the graph kept, each node where a weight's gradient branches off the input's path (an
"intermediate": the matmul whose other operand is the weight) handing the gradient it received
to a hook. So B runs every node of the input's path once and no weight's gradient.

W then runs, from each intermediate and the gradient it kept, the weight's side only, as
``stage_backward_weight`` does: no forward is rerun (but a layer that full recomputation
checkpoints, whose saved tensors are rebuilt at each backward that reads them), and each
weight's gradient is exactly what one full backward computes, by the same operations. Unlike
torch's, W gives the gradients to the weights through autograd's own accumulation, in one
backward of the engine: so the hooks a backward runs (runtime.precision's move into the fp32
main gradients at the end of each backward of a chunk, an overlapped gradient sync's hooks on
each weight's last gradient) run in W as in a full backward, once, after every weight's.

What W holds until it runs: the chunk's autograd graph for the micro-batch, with its saved
activations (B keeps the graph; only W frees it), and the gradients at the intermediates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from hethub.runtime.torch_support import grad_accumulator, stage_backward_input


class WeightPass:
    """The weights' gradients of one (chunk, micro-batch), kept by ``input_backward`` for
    ``run``: the intermediates and the gradients B gave them, or the whole output and its
    gradient where the chunk's input takes no gradient (the first chunk, whose input is tokens:
    B has nothing to compute there, and W is its full backward)."""

    def __init__(
        self,
        weights: Sequence[nn.Parameter],
        param_groups: list[dict[str, Any]] | None = None,
        whole: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> None:
        self.weights, self.param_groups, self.whole = list(weights), param_groups, whole
        self.accumulators: dict[torch.autograd.graph.Node, int] = {}
        """Each weight's accumulation node, by the weight's index (set by ``run``)."""

    def run(self) -> None:
        """W: the weights' gradients, accumulated into their .grad by autograd (their hooks run
        as in a full backward); what B kept is then freed."""
        if self.whole is not None:
            output, grad = self.whole
            self.whole = None
            output.backward(grad)
            return
        # One node whose inputs are the weights: autograd's accumulation gives them their
        # gradients, which its backward computes, in one backward of the engine. The weights'
        # accumulation nodes are looked up here, where grad mode is on (a lookup makes a view).
        self.accumulators = {grad_accumulator(w): i for i, w in enumerate(self.weights)}
        _WeightGradients.apply(self, *self.weights).backward()

    def gradients(self) -> list[torch.Tensor | None]:
        """Each weight's gradient from the intermediates (None where it takes none): for each
        group of weights reached from the same intermediates, one autograd.grad from those to
        the weights, the graph freed as it goes (stage_backward_weight's walk)."""
        index, self.accumulators = self.accumulators, {}
        grads: list[torch.Tensor | None] = [None] * len(self.weights)
        groups, self.param_groups = self.param_groups or [], None
        for group in groups:
            intermediates, received = group.pop("intermediates"), group.pop("grads", None)
            if received is None:  # B never reached them: no gradient flows to these weights
                continue
            edges, outputs = [], []
            for grads_in, node in zip(received, intermediates, strict=True):
                for i, grad in enumerate(grads_in):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        outputs.append(grad)
            # An intermediate below another in the group would take the upper one's gradient
            # again: each takes exactly what B gave it.
            clamps = (
                [
                    node.register_prehook(lambda _, kept=grads_in: kept)
                    for grads_in, node in zip(received, intermediates, strict=True)
                ]
                if len(intermediates) > 1
                else []
            )
            try:
                params = list(group["params"])
                computed = torch.autograd.grad(
                    edges, [GradientEdge(p, 0) for p in params], grad_outputs=outputs
                )
            finally:
                for clamp in clamps:
                    clamp.remove()
            for param, grad in zip(params, computed, strict=True):
                i = index[param]
                grads[i] = grad if grads[i] is None else grads[i] + grad
        return grads


class _WeightGradients(torch.autograd.Function):
    """A node whose inputs are a chunk's weights and whose backward is WeightPass.gradients."""

    @staticmethod
    def forward(ctx, weight_pass: WeightPass, *weights: torch.Tensor) -> torch.Tensor:
        ctx.weight_pass = weight_pass
        return weights[0].new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight_pass, ctx.weight_pass = ctx.weight_pass, None
        return (None, *weight_pass.gradients())


def input_backward(
    output: torch.Tensor,
    grad: torch.Tensor | None,
    x: torch.Tensor | None,
    weights: Sequence[nn.Parameter],
) -> WeightPass:
    """B of one (chunk, micro-batch): the gradient of ``output`` (the chunk's activation, or its
    loss where ``grad`` is None) with respect to its input ``x``, left in x.grad; what W needs of
    it (WeightPass). ``x`` None (the first chunk: tokens): nothing is computed, W will run the
    whole backward."""
    if x is None:
        return WeightPass(weights, whole=(output, grad))
    _, param_groups = stage_backward_input(
        [output], None if grad is None else [grad], [x], iter(weights)
    )
    return WeightPass(weights, param_groups)
