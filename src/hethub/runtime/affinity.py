"""Which CPU cores a rank runs on: each of a machine's ranks bound to its own share of the cores
when they have at least one each, as the profiler measured them.

Why bind: left to the operating system, two single-threaded ranks on two cores do not each keep
a core. The scheduler moves them, and their communication threads, between the cores, and a
2-stage pipeline on this 2-core machine ran 7-15% slower than its profile. Bound, it ran as
profiled. Binding is also what serious CPU training does, to keep a rank's memory in its
core's caches.

More ranks than cores (4 ranks on 2 cores) are left to the operating system: any fixed
placement would put the two busiest ranks on one core at some moment while another idles.
The predictor models that sharing (predictor.sharing).
"""

from __future__ import annotations

import os


def cores_for(local_rank: int, local_ranks: int, cores: list[int]) -> list[int] | None:
    """The cores of ``local_rank``, one of ``local_ranks`` ranks sharing ``cores``: an equal,
    contiguous share each (the remainder unused); None when there are more ranks than cores."""
    share = len(cores) // local_ranks
    if share == 0:
        return None
    return cores[local_rank * share : (local_rank + 1) * share]


def bind_rank(local_rank: int, local_ranks: int) -> list[int] | None:
    """Bind this process to its share of the cores it may run on now (see cores_for); the cores,
    or None where it stays unbound (more ranks than cores, or no affinity on this platform)."""
    if not hasattr(os, "sched_setaffinity"):  # not on Linux
        return None
    mine = cores_for(local_rank, local_ranks, sorted(os.sched_getaffinity(0)))
    if mine is not None:
        os.sched_setaffinity(0, mine)
    return mine
