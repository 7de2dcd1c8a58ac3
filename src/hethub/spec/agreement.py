"""Checks that every rank's part of a step fits the others' (the dry run's, hethub train
--dry-run): the pipeline's sends and receives walked in each stage's order (walk_messages), and
every rank's transfers in the plan of a step's traffic run together (check_agreement), each
collective blocking until its group's ranks all reach it. A mismatch or a deadlock here hangs or
corrupts a real job; here it is one line naming the rank and the rule."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

from hethub.errors import HethubError
from hethub.spec.collectives import Kind, Post, Transfer


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


def check_agreement(transfers_of: Iterable[tuple[int, Sequence[Transfer]]]) -> int:
    """Check that the ranks' transfers of one step (``transfers_of``: every rank with its
    rank_transfers, in the order it runs them) fit together, as walk_messages does for the
    schedule's messages: each collective blocks until every rank of its group reaches it, so
    the collectives are run until none can proceed; ranks meeting in a collective must agree on
    its kind and size, and every rank must finish. Every message sent must be received once,
    with the same bytes. Returns the step's collectives (each counted once); raises
    HethubError naming a rank and the rule otherwise: a collective reached in another order,
    or with another size, hangs a real job or sums the wrong elements."""
    queues: dict[int, list[Transfer]] = {}
    messages: Counter = Counter()
    for rank, transfers in transfers_of:
        queues[rank] = []
        for t in transfers:
            if t.kind is Kind.SEND:
                messages[(t.ranks, t.nbytes, t.phase)] += 1
            elif t.kind is Kind.RECV:
                messages[(t.ranks, t.nbytes, t.phase)] -= 1
            else:
                queues[rank].append(t)
    at = dict.fromkeys(queues, 0)
    waiting: dict[tuple[int, ...], list[int]] = {}  # group -> its ranks there, at its collective
    ready: deque = deque()

    def arrive(rank: int) -> None:
        if at[rank] < len(queues[rank]):
            group = queues[rank][at[rank]].ranks
            there = waiting.setdefault(group, [])
            there.append(rank)
            if len(there) == len(group):
                ready.append(group)

    for rank in queues:
        arrive(rank)
    collectives = 0
    while ready:
        group = ready.popleft()
        there = waiting.pop(group)
        runs = [queues[rank][at[rank]] for rank in there]
        for rank, run in zip(there[1:], runs[1:]):
            if (run.kind, run.nbytes) != (runs[0].kind, runs[0].nbytes):
                raise HethubError(
                    f"ranks {there[0]} and {rank} meet in group {_said_ranks(group)} with a "
                    f"{runs[0].kind} of {runs[0].nbytes} bytes and a {run.kind} of {run.nbytes}: "
                    "the ranks of a group run its collectives in one order and size"
                )
        collectives += 1
        for rank in there:
            at[rank] += 1
            arrive(rank)
    for rank, mine in queues.items():
        if at[rank] < len(mine):
            run = mine[at[rank]]
            there = waiting.get(run.ranks, [])
            absent = next(r for r in run.ranks if r not in there)
            elsewhere = (
                f"waits in another collective ({queues[absent][at[absent]].phase} among ranks "
                f"{_said_ranks(queues[absent][at[absent]].ranks)})"
                if absent in queues and at[absent] < len(queues[absent])
                else "never reaches it"
            )
            raise HethubError(
                f"rank {rank} waits forever in the {run.kind} of {run.phase} among ranks "
                f"{_said_ranks(run.ranks)}: rank {absent} {elsewhere}; every rank of a group "
                "reaches its collectives in one order (deadlock)"
            )
    for (pair, nbytes, phase), unmatched in messages.items():
        if unmatched:
            sender, receiver = pair
            side = "sends" if unmatched > 0 else "receives"
            raise HethubError(
                f"rank {sender} {side} {abs(unmatched)} more {phase} message(s) of {nbytes} "
                f"bytes to rank {receiver} than rank {receiver} takes: every send needs its "
                "receive"
            )
    return collectives


def _said_ranks(ranks: tuple[int, ...]) -> str:
    """A group's ranks, shortened where it spans many."""
    return str(ranks) if len(ranks) <= 8 else f"({ranks[0]}, {ranks[1]}, ..., {ranks[-1]})"
