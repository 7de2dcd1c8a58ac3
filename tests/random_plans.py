"""Random plans for the property tests: the shapes every layout may take, drawn by hypothesis."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from hethub.spec import parse_plan
from hethub.spec.plan import Plan


def random_plan(
    data: st.DataObject,
    *,
    model: str,
    groups: Sequence[str],
    tps: Sequence[int],
    layers: int = 8,
    shard_optimizer: bool = False,
) -> Plan:
    """A plan of 1-3 layouts (1 or 2 replicas each) of 1-3 stages over the model's ``layers``,
    each stage on one of ``groups`` with one of the TP degrees ``tps``: not necessarily one a
    cluster can hold (check_plan decides)."""
    pipelines = []
    for _ in range(data.draw(st.integers(1, 3))):
        stages = data.draw(st.integers(1, 3))
        split = [1] * stages
        for _ in range(layers - stages):
            split[data.draw(st.integers(0, stages - 1))] += 1
        pipelines.append(
            {
                "count": data.draw(st.integers(1, 2)),
                "micro_batches": 1,
                "stages": [
                    {
                        "group": data.draw(st.sampled_from(list(groups))),
                        "tp": data.draw(st.sampled_from(list(tps))),
                        "layers": n,
                    }
                    for n in split
                ],
            }
        )
    return parse_plan(
        {
            "model": model,
            "global_batch": sum(p["count"] for p in pipelines),
            "shard_optimizer": shard_optimizer,
            "pipelines": pipelines,
        }
    )
