"""The zero-bubble schedules' bubble against 1F1B's (issue 28, item 2): the predictor's
simulation (predictor.schedule) of the orders spec.schedules defines for the runtime, at equal
F, B and W (1F1B's backward is B and W together; ZBV's chunks each half a stage) and, on the
same stages, at unlike costs (each stage's F drawn 1-2, B and W near it: seeded). Sends are
left out; the bubble is the stages' idle time over their span, 1 - work / (p x step).

Usage: python benchmarks/zero_bubble.py
"""

from __future__ import annotations

import random

from hethub.predictor.schedule import schedule_order, simulate
from hethub.spec.schedules import Schedule, chunks_per_stage, model_chunk

SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.ZB_H1, Schedule.ZBV)


def bubble(schedule: Schedule, p: int, m: int, stage_costs: list[tuple[float, float, float]]):
    """The bubble of ``schedule`` over p stages of (F, B, W) per micro-batch, a stage's chunks
    sharing its costs equally."""
    v = chunks_per_stage(schedule) or 1
    owner = {model_chunk(schedule, s, p, c): s for s in range(p) for c in range(v)}
    forward, backward, weight = (
        [stage_costs[owner[g]][kind] / v for g in range(p * v)] for kind in range(3)
    )
    if not schedule.splits_backward:
        backward = [b + w for b, w in zip(backward, weight)]
    order = schedule_order(schedule, p, m, v)
    free = [0.0] * (p * v - 1)
    kwargs = {"weight_s": weight} if schedule.splits_backward else {}
    end = simulate(order, forward, backward, free, free, **kwargs)
    step = max(end[i] for i in order.last_op)
    work = m * sum(sum(costs) for costs in stage_costs)
    return 1 - work / (p * step)


def main() -> None:
    rng = random.Random(0)
    print("          equal F = B = W          unlike stages (seeded)")
    print(" p   m   " + "  ".join(f"{s.value:>6}" for s in SCHEDULES * 2))
    for p in (4, 8):
        unlike = []
        for _ in range(p):
            forward = rng.uniform(1.0, 2.0)
            backward, weight = forward * rng.uniform(0.9, 1.3), forward * rng.uniform(0.6, 1.1)
            unlike.append((forward, backward, weight))
        for m in (p, 2 * p, 4 * p):
            equal = [bubble(s, p, m, [(1.0, 1.0, 1.0)] * p) for s in SCHEDULES]
            drawn = [bubble(s, p, m, unlike) for s in SCHEDULES]
            print(f"{p:>2}  {m:>2}   " + "  ".join(f"{b:6.1%}" for b in equal + drawn))


if __name__ == "__main__":
    main()
