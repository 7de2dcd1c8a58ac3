"""The plan of a step's traffic: every message and collective a rank takes part in, with its
ranks, its bytes and its path, as a pure function of the plan (no torch, as spec.schedules and
spec.buckets). The runtime's Communicator counts what it moves by ``moved_bytes`` (the ring
factors live here and nowhere else); the predictor reports the same list's bytes
(``hethub predict --json``: comm_bytes) and prices the gradient sync from it; the dry run walks
its point-to-point posts (``stage_posts``, ``walk_messages``); and tests hold the runtime's
counted bytes, rank by rank, to this list's.

What a rank counts, as the Communicator counts it: the bytes it moves out of itself. A message
counts once at its sender and once at its receiver; a broadcast once on every rank; an
all-reduce over n ranks 2 (n - 1) / n of its tensor (a ring: a reduce-scatter then an
all-gather); a reduce-scatter (or the funnel's reduce) (n - 1) / n of its input; an all-gather
n - 1 times its piece.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from hethub.errors import HethubError
from hethub.spec.schedules import BACKWARD, FORWARD

NATIVE, BRIDGE = "native", "bridge"


class Kind(enum.StrEnum):
    """What a transfer is: a message's two ends, or a collective."""

    SEND = "send"
    RECV = "recv"
    BROADCAST = "broadcast"
    ALL_REDUCE = "all-reduce"
    REDUCE = "reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"


def moved_bytes(kind: Kind, nbytes: int, ranks: int) -> int:
    """The bytes one rank of ``ranks`` moves in a transfer of ``nbytes`` (the tensor it passes:
    an all-reduce's or a broadcast's tensor, a reduce-scatter's input, an all-gather's piece, a
    message), as a ring runs it; whole bytes, rounded down."""
    if kind in (Kind.SEND, Kind.RECV):
        return nbytes
    if ranks <= 1:
        return 0
    if kind is Kind.BROADCAST:
        return nbytes
    if kind is Kind.ALL_REDUCE:
        return 2 * (ranks - 1) * nbytes // ranks
    if kind in (Kind.REDUCE, Kind.REDUCE_SCATTER):
        return (ranks - 1) * nbytes // ranks
    return (ranks - 1) * nbytes  # an all-gather brings the n - 1 other pieces in


def ring_steps(kind: Kind, ranks: int) -> int:
    """How many messages one rank of a ring sends one after the other in a collective over
    ``ranks`` (each paying the link's latency): 2 (n - 1) for an all-reduce, n - 1 for a
    reduce-scatter or an all-gather, one for a broadcast or a message."""
    if kind in (Kind.SEND, Kind.RECV):
        return 1
    if ranks <= 1:
        return 0
    if kind is Kind.ALL_REDUCE:
        return 2 * (ranks - 1)
    if kind is Kind.BROADCAST:
        return 1
    return ranks - 1


def path_of(ranks: Sequence[int], vendors: Sequence[str]) -> str:
    """NATIVE when every one of ``ranks`` is of one vendor, else BRIDGE."""
    return NATIVE if len({vendors[r] for r in ranks}) == 1 else BRIDGE


# --- the pipeline's messages ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Post:
    """One message a stage posts, in its order: a send to or a receive from ``peer`` (a stage of
    the same pipeline) of ``message`` (what it carries: kind, model chunk, micro-batch), over
    ``link``: the ordered pair of stages whose process group carries it (a boundary's
    activations and their gradients share one; ZBV's way back has its own, as
    process_groups.rank_groups gives it)."""

    sends: bool
    peer: int
    message: tuple[str, int, int]
    link: tuple[int, int] = (0, 0)


def stage_posts(orders: Sequence[Sequence[tuple[int, int, int]]], model_chunks) -> list[list[Post]]:
    """The sends and receives of each stage of a pipeline, in the order it posts them, from its
    (kind, chunk, micro-batch) order: a forward of model chunk g receives g - 1's activation and
    sends its own on to g + 1's stage; a backward receives g + 1's gradient and sends its own
    back to g - 1's. A neighbour chunk on the same stage (ZBV's turn) sends nothing."""
    holder = {g: s for s, chunks in enumerate(model_chunks) for g in chunks}
    last = len(holder) - 1
    posts: list[list[Post]] = []
    for s, order in enumerate(orders):
        mine: list[Post] = []
        for kind, chunk, j in order:
            g = model_chunks[s][chunk]
            if kind == FORWARD:
                steps = ((g - 1, False, g - 1), (g + 1, True, g))
                label = "activation"
            elif kind == BACKWARD:
                steps = ((g + 1, False, g + 1), (g - 1, True, g))
                label = "gradient"
            else:
                continue
            for neighbour, sends, source in steps:
                if 0 <= neighbour <= last and holder[neighbour] != s:
                    low = min(g, neighbour)  # the boundary between model chunks low and low + 1
                    link = (holder[low], holder[low + 1])
                    mine.append(Post(sends, holder[neighbour], (label, source, j), link))
        posts.append(mine)
    return posts


def walk_messages(posts: Sequence[Sequence[Post]], name=str) -> int:
    """Run every stage's posts as the pipeline would: a send delivers at once (the runtime's
    isend), a receive waits for its peer's send, and messages from one stage to another over
    one link match in the order posted. Returns the messages sent; raises HethubError naming
    the stage (``name(s)``) and the rule on a mismatch, a receive never served (a deadlock) or
    a send never received."""
    queues: dict[tuple[int, int, tuple[int, int]], deque] = {}
    at = [0] * len(posts)
    sent = 0
    progress = True
    while progress:
        progress = False
        for s, mine in enumerate(posts):
            while at[s] < len(mine):
                post = mine[at[s]]
                if post.sends:
                    queues.setdefault((s, post.peer, post.link), deque()).append(post.message)
                    sent += 1
                else:
                    queue = queues.get((post.peer, s, post.link))
                    if not queue:
                        break
                    if queue[0] != post.message:
                        raise HethubError(
                            f"{name(s)} receives {_said(post.message)} from {name(post.peer)}, "
                            f"whose next send to it is {_said(queue[0])}: sends and receives "
                            "between two stages must match in order"
                        )
                    queue.popleft()
                at[s] += 1
                progress = True
    for s, mine in enumerate(posts):
        if at[s] < len(mine):
            post = mine[at[s]]
            raise HethubError(
                f"{name(s)} waits forever to receive {_said(post.message)} from "
                f"{name(post.peer)} (deadlock): every receive needs a send its peer reaches"
            )
    for (s, peer, _), queue in queues.items():
        if queue:
            raise HethubError(
                f"{name(s)} sends {_said(queue[0])} to {name(peer)}, which never receives it: "
                "every send needs its receive"
            )
    return sent


def _said(message: tuple[str, int, int]) -> str:
    label, chunk, micro_batch = message
    return f"the {label} of chunk {chunk}, micro-batch {micro_batch}"
