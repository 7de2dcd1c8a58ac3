"""A step's traffic as the predictor reports it: the bytes every rank moves on each path
(natively inside a vendor, over the bridge across vendors), from the same plan of a step's
transfers that the runtime's Communicator counts against (spec.collectives), in the units of
metrics.jsonl's ``comm_bytes`` and ``comm_bytes_busiest_rank``.

Listed rank by rank, a cost that grows with the rank count: `hethub predict` and a run's
prediction.json report it once, and the planner, which prices thousands of plans, does not.
"""

from __future__ import annotations

from hethub.spec.cluster import ClusterSpec
from hethub.spec.collectives import step_comm_bytes
from hethub.spec.model import ModelSpec
from hethub.spec.plan import Plan
from hethub.spec.topology import build_topology


def predicted_traffic(plan: Plan, cluster: ClusterSpec, model: ModelSpec) -> dict:
    """{"comm_bytes": {path: bytes}, "comm_bytes_busiest_rank": {path: bytes}} of one training
    step of ``plan`` as `hethub train` runs it (the global gradient norm summed every step):
    the sum over ranks, and the most any one rank moves."""
    topology = build_topology(plan, cluster)
    total, busiest = step_comm_bytes(
        plan, topology, model, topology.vendors(cluster), grad_norm=True
    )
    return {"comm_bytes": total, "comm_bytes_busiest_rank": busiest}
