"""Who syncs gradients with whom is spec.topology's answer, read by the predictor: its
data-parallel degrees are the topology's peers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hethub.errors import SpecError
from hethub.spec import check_plan, load_model, parse_cluster, parse_plan
from hethub.spec.topology import build_topology, data_parallel_degrees, layout_classes

TWO = parse_cluster(
    {
        "groups": [
            {"name": "a", "accelerator": "cpu", "nodes": 1, "devices_per_node": 8},
            {"name": "b", "accelerator": "cpu", "nodes": 1, "devices_per_node": 8},
        ]
    }
)


def _random_plan(data) -> object:
    pipelines = []
    for _ in range(data.draw(st.integers(1, 3))):
        stages = data.draw(st.integers(1, 3))
        split = [1] * stages
        for _ in range(8 - stages):
            split[data.draw(st.integers(0, stages - 1))] += 1
        pipelines.append(
            {
                "count": data.draw(st.integers(1, 2)),
                "micro_batches": 1,
                "stages": [
                    {
                        "group": data.draw(st.sampled_from(["a", "b"])),
                        "tp": data.draw(st.sampled_from([1, 2])),
                        "layers": n,
                    }
                    for n in split
                ],
            }
        )
    return parse_plan(
        {
            "model": "tiny-llama",
            "global_batch": sum(p["count"] for p in pipelines),
            "pipelines": pipelines,
        }
    )


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_data_parallel_degrees_are_the_topology_s_peers(data) -> None:
    plan = _random_plan(data)
    try:
        check_plan(plan, TWO, load_model("tiny-llama"))
    except SpecError:
        return
    topology = build_topology(plan, TWO)
    classes, degrees = layout_classes(plan), data_parallel_degrees(plan)
    for rank in topology.ranks:
        assert rank.layout_class == classes[rank.pipeline]
        assert len(topology.data_parallel_peers(rank.rank)) == degrees[rank.pipeline]
