"""Whether a plan fits a model and a cluster: the checks that need all three (a plan file alone
is checked as it is parsed, in spec.plan)."""

from __future__ import annotations

from hethub.errors import SpecError
from hethub.spec.cluster import ClusterSpec
from hethub.spec.fields import suggestion
from hethub.spec.model import ModelSpec
from hethub.spec.placement import place
from hethub.spec.plan import Plan
from hethub.spec.schedules import Schedule


def check_plan(
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    source: str = "",
    *,
    tp_within_node: bool = True,
) -> None:
    """Raise SpecError unless the plan fits the model and the cluster's groups and device counts.

    ``tp_within_node=False`` lets a stage's TP span whole nodes: the predictor prices that (on the
    network) for measured reference runs, but hethub's planner and runtime never do it.
    """
    for i, pipeline in enumerate(plan.pipelines):
        if pipeline.schedule == Schedule.ZBV and model.tied_head:
            # The V's first stage holds the embedding and the head, tied to it: the runtime
            # would hold two parameters of one name on one rank (not run exactly yet).
            raise SpecError(
                source,
                f"pipelines[{i}].schedule",
                Schedule.ZBV.value,
                "does not run a model whose head is tied to its embedding (tie_word_embeddings): "
                "its first stage would hold both; use zb-h1",
            )
        layers = sum(stage.layers for stage in pipeline.stages)
        if layers != model.layers:
            split = "+".join(str(s.layers) for s in pipeline.stages)
            raise SpecError(
                source,
                f"pipelines[{i}].stages[*].layers",
                split,
                f"must sum to the model's {model.layers} layers (they sum to {layers})",
            )
        for j, stage in enumerate(pipeline.stages):
            field = f"pipelines[{i}].stages[{j}]"
            if stage.group not in cluster.group_names:
                raise SpecError(
                    source,
                    f"{field}.group",
                    stage.group,
                    f"no such group in the cluster{suggestion(stage.group, cluster.group_names)}; "
                    f"groups: {', '.join(cluster.group_names)}",
                )
            group = cluster.group(stage.group)
            spans_nodes = not tp_within_node and stage.tp % group.devices_per_node == 0
            if not spans_nodes and (
                stage.tp > group.devices_per_node or group.devices_per_node % stage.tp
            ):
                raise SpecError(
                    source,
                    f"{field}.tp",
                    stage.tp,
                    f"tensor parallelism stays inside a node: must divide devices_per_node "
                    f"({group.devices_per_node}) of group {group.name!r}",
                )
            if model.heads % stage.tp or model.kv_heads % stage.tp:
                raise SpecError(
                    source,
                    f"{field}.tp",
                    stage.tp,
                    f"must divide the model's heads ({model.heads}) "
                    f"and kv_heads ({model.kv_heads})",
                )
            for what, size in (("vocab", model.vocab), ("ffn_hidden", model.ffn_hidden)):
                if size % stage.tp:
                    raise SpecError(
                        source,
                        f"{field}.tp",
                        stage.tp,
                        f"must divide the model's {what} ({size}): TP splits it in equal slices",
                    )
            if plan.sequence_parallel and model.seq_len % stage.tp:
                raise SpecError(
                    source,
                    f"{field}.tp",
                    stage.tp,
                    f"sequence_parallel splits the sequence over the stage's TP ranks: tp must "
                    f"divide the model's seq_len ({model.seq_len})",
                )
    place(plan, cluster, source)  # the device counts, and whether the plan fits once placed
