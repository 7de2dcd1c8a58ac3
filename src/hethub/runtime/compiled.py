"""torch.compile of each transformer layer, where a plan says ``compile: true``, as torchtitan
compiles per block.

Per layer, not the whole stage: a stage's layers are one module class at one shape, and dynamo
(inlining nn modules, torch's default) takes each layer's parameters as inputs of its graph, so
every layer of a rank runs one compiled graph: a stage compiles once, whatever its layers
(tests/test_compile.py counts the graphs). The embedding, the final norm, the head and the loss
stay eager: they run once a micro-batch, not once a layer, and the pipeline's schedule, its
sends, the gradient hooks and the recomputation (torch.utils.checkpoint around each layer) stay
eager around the compiled layers, as they are.

Compiled after the weights are placed (runtime.precision moves every parameter into its flat
buffer and makes bf16's weights bf16): the graph is made at the first call anyway, and by then
each parameter is the view it stays. The stage's rotary tables are made in the compute dtype
here, before that first call: they otherwise follow the activations' dtype at the first forward
(runtime.model.Rotary), and a compiled layer that sees them change compiles a second graph.

fullgraph everywhere: at TP > 1 dynamo traces the region functions (autograd Functions around
torch.distributed's all-reduce, runtime.tensor_parallel) into the graph too, so a break would be
a failure to see, not a cost to accept.
"""

from __future__ import annotations

from hethub.runtime.model import Rotary, StageChunks
from hethub.runtime.precision import COMPUTE_DTYPE
from hethub.runtime.torch_support import dynamo_unique_graphs, is_compiled
from hethub.spec.plan import Plan


def compile_layers(stage: StageChunks, plan: Plan) -> None:
    """Where ``plan`` compiles (its ``compile``), compile every transformer layer of ``stage``
    in place (nn.Module.compile); otherwise nothing. Compilation itself happens at the first
    forward."""
    if not plan.compile:
        return
    dtype = COMPUTE_DTYPE[plan.precision]
    for module in stage.modules():
        if isinstance(module, Rotary):
            module.reset_tables(dtype)
    for chunk in stage.chunks:
        for layer in chunk.layers.values():
            layer.compile(fullgraph=True)


def compiled_layers(stage: StageChunks) -> int:
    """How many of ``stage``'s transformer layers run compiled: a check that a run asked to
    compile did."""
    return sum(is_compiled(layer) for chunk in stage.chunks for layer in chunk.layers.values())


def compiled_graphs() -> int:
    """How many distinct graphs dynamo has compiled in this process so far."""
    return dynamo_unique_graphs()
