"""The order in which one pipeline stage runs its micro-batches: the schedules' definition,
shared by the predictor (which simulates it) and the runtime (which runs it)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from hethub.memo import memoized

FORWARD, BACKWARD, WEIGHT = 0, 1, 2
"""The kinds of operation a stage runs on one chunk and micro-batch. Under the zero-bubble
schedules a backward is split in two: BACKWARD then computes the input's gradient only (what
the stage before waits for) and WEIGHT the weights' gradients, later, in the bubbles; under the
other schedules BACKWARD computes both and no WEIGHT is run."""


class Schedule(enum.StrEnum):
    """A plan's pipeline schedule; its value is how plan files spell it."""

    ONE_F_ONE_B = "1f1b"
    """Each stage alternates one forward and one backward once its pipeline is full."""
    GPIPE = "gpipe"
    """Every forward, then every backward."""
    INTERLEAVED_1F1B = "interleaved-1f1b"
    """1F1B over ``virtual_stages`` chunks per stage (interleaved_sequence); a pipeline of one
    chunk per stage runs plain 1F1B."""
    ZB_H1 = "zb-h1"
    """Zero bubble at 1F1B's activation memory (Qi et al., ICLR 2024): one chunk per stage, each
    backward split into its input's gradient and its weights' (WEIGHT), the weights' run late to
    fill the bubbles."""
    ZBV = "zbv"
    """Zero bubble in a V (Qi et al., NeurIPS 2024): two chunks per stage, stage s holding the
    model's chunks s and 2p - 1 - s (model_chunk), backwards split as under ZB_H1."""

    @property
    def splits_backward(self) -> bool:
        """Whether a backward is split into BACKWARD (the input's gradient) and WEIGHT."""
        return self in (Schedule.ZB_H1, Schedule.ZBV)


def model_chunk(schedule: Schedule, stage: int, stages: int, chunk: int) -> int:
    """The model chunk (0 holds the embedding, the last the head) that chunk ``chunk`` of
    ``stage`` of ``stages`` holds: c x p + s under interleaving (each micro-batch passes every
    stage once per chunk), a V under ZBV (stage s holds chunks s and 2p - 1 - s, so the first
    stage holds the first and the last chunk and the last stage's two chunks meet locally)."""
    if schedule == Schedule.ZBV:
        return stage if chunk == 0 else 2 * stages - 1 - stage
    return chunk * stages + stage


@memoized
def stage_model_chunks(schedule: Schedule, stages: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    """Each stage's model chunks, chunk by chunk (model_chunk over the whole pipeline): what
    every walk of a pipeline's chunks reads."""
    return tuple(
        tuple(model_chunk(schedule, s, stages, c) for c in range(chunks)) for s in range(stages)
    )


def chunks_per_stage(schedule: Schedule) -> int | None:
    """The chunks every stage holds under ``schedule``, where it fixes them (None: any count,
    interleaved 1F1B's virtual_stages)."""
    if schedule == Schedule.INTERLEAVED_1F1B:
        return None
    return 2 if schedule == Schedule.ZBV else 1


def stage_sequence(
    schedule: Schedule, stage: int, stages: int, micro_batches: int
) -> list[tuple[int, int]]:
    """The (kind, micro-batch) operations one stage runs, in order."""
    m = micro_batches
    if schedule == Schedule.GPIPE:
        return [(FORWARD, j) for j in range(m)] + [(BACKWARD, j) for j in range(m)]
    warmup = min(stages - stage - 1, m)
    sequence = [(FORWARD, j) for j in range(warmup)]
    for j in range(m - warmup):  # steady state: one forward, one backward
        sequence += [(FORWARD, warmup + j), (BACKWARD, j)]
    sequence += [(BACKWARD, j) for j in range(m - warmup, m)]  # cool-down
    return sequence


@memoized
def in_flight_micro_batches(
    schedule: Schedule,
    position: int,
    stages: int,
    micro_batches: int,
    chunks: tuple[int, ...] = (1,),
) -> float:
    """Micro-batches of the whole stage's activations the stage at ``position`` holds at its
    peak: peak_in_flight's walk of its order, read in closed form where a test proves the two
    equal (one chunk: 1F1B keeps stages - position, GPipe every micro-batch, ZB-H1 the
    pipeline's depth on every stage, its W's held back; equal chunks: megatron_in_flight), as a
    planner asks this a lot. ``chunks``: the stage's layers per chunk (one count under ZBV: two
    equal chunks)."""
    if len(chunks) == 1 and chunks_per_stage(schedule) == 2:
        chunks *= 2
    if len(chunks) == 1:
        if schedule == Schedule.GPIPE:
            return micro_batches
        if schedule == Schedule.ZB_H1:
            return min(stages, micro_batches)
        return min(stages - position, micro_batches)
    if schedule == Schedule.INTERLEAVED_1F1B and len(set(chunks)) == 1:
        return megatron_in_flight(position, stages, micro_batches, len(chunks))
    return peak_in_flight(schedule, position, stages, micro_batches, chunks)


def megatron_in_flight(position: int, stages: int, micro_batches: int, chunks: int) -> float:
    """Micro-batches in flight at the peak of the stage at ``position`` under interleaved 1F1B
    with ``chunks`` equal chunks: its warm-up (interleaved_warmup) and the steady state's first
    forward, each a chunk's share of a micro-batch. Exactly peak_in_flight's walk, for any
    micro-batch count; cheap where building the order is not."""
    warmup = interleaved_warmup(position, stages, chunks, micro_batches)
    return min(warmup + 1, micro_batches * chunks) / chunks


@memoized
def peak_in_flight(
    schedule: Schedule, position: int, stages: int, micro_batches: int, chunks: tuple[int, ...]
) -> float:
    """Micro-batches of the whole stage's activations the stage at ``position`` holds at its
    peak, by walking its order (chunk_sequence): a forward of chunk c holds its layers'
    activations until its backward, so the peak of the chunks' layers in flight, over the
    stage's layers, is fractional where the chunks differ or are not all in flight.

    Under the zero-bubble schedules a chunk's activations are held from its forward until its
    WEIGHT: W reads the linears' inputs and output gradients, which together weigh what the
    forward keeps (predictor.weight_split.weight_held_share: 99.6-99.9% of it), so B frees
    next to nothing."""
    freed_by = WEIGHT if Schedule(schedule).splits_backward else BACKWARD
    held = peak = 0
    for kind, c, _ in chunk_sequence(schedule, position, stages, len(chunks), micro_batches):
        if kind == FORWARD:
            held += chunks[c]
            peak = max(peak, held)
        elif kind == freed_by:
            held -= chunks[c]
    whole, layers = divmod(peak, sum(chunks))
    return whole if not layers else peak / sum(chunks)


def chunk_sequence(
    schedule: Schedule, stage: int, stages: int, chunks: int, micro_batches: int
) -> list[tuple[int, int, int]]:
    """The (kind, chunk, micro-batch) operations one stage runs, in order, under any schedule:
    what the runtime runs and the predictor simulates. Chunk c of the stage is the model's
    model_chunk(schedule, stage, stages, c); interleaved 1F1B holds any count of chunks, ZBV
    two, the others one (the plan refuses the rest). Under the zero-bubble schedules every
    micro-batch's BACKWARD of a chunk is followed, later, by its WEIGHT."""
    if schedule == Schedule.INTERLEAVED_1F1B:
        return interleaved_sequence(stage, stages, chunks, micro_batches)
    if schedule == Schedule.ZB_H1:
        return zb_h1_sequence(stage, stages, micro_batches)
    if schedule == Schedule.ZBV:
        return zbv_sequence(stage, stages, micro_batches)
    if chunks != 1:
        raise ValueError(f"schedule {schedule} runs one chunk per stage, not {chunks}")
    return [(kind, 0, j) for kind, j in stage_sequence(schedule, stage, stages, micro_batches)]


def zb_h1_sequence(stage: int, stages: int, micro_batches: int) -> list[tuple[int, int, int]]:
    """ZB-H1 (Qi et al., ICLR 2024): the (kind, chunk, micro-batch) operations of ``stage`` of
    ``stages``, one chunk per stage. 1F1B's order (its warm-up of p - s - 1 forwards, then one
    forward and one input-gradient backward at a time, then the backwards left), each backward
    being only B, sent on at once; stage s runs each W ``s`` backwards after its B, and the s
    W's left at the end fill the cool-down, where 1F1B waits for the gradients to come back.
    The first stage, whose W's no stage waits behind, runs each at once. At F = B = W the
    bubble is (p - 1)(F + B - W): a third of 1F1B's (p - 1)(F + B + W), for m >= p."""
    p, m, s = stages, micro_batches, stage
    warmup = min(p - s - 1, m)
    sequence = [(FORWARD, 0, j) for j in range(warmup)]
    for j in range(m):  # j: the backward; the steady state's forward before it, its W after
        if warmup + j < m:
            sequence.append((FORWARD, 0, warmup + j))
        sequence.append((BACKWARD, 0, j))
        if j >= s:
            sequence.append((WEIGHT, 0, j - s))
    sequence += [(WEIGHT, 0, j) for j in range(max(m - s, 0), m)]  # the cool-down's bubbles
    return sequence


def zbv_sequence(stage: int, stages: int, micro_batches: int) -> list[tuple[int, int, int]]:
    """ZBV (Qi et al., NeurIPS 2024; torch's ScheduleZBVZeroBubble): the (kind, chunk,
    micro-batch) operations of ``stage`` of ``stages``, which holds two chunks in a V (its chunk
    0 the model's chunk s, its chunk 1 chunk 2p - 1 - s: model_chunk). The order is built for
    at least 2p - 1 micro-batches (the warm-up fills the V) and the operations of micro-batches
    beyond ``micro_batches`` are left out: each micro-batch's operations depend only on its own,
    so what is left runs in the same dependency order.

    Warm-up: 2 (p - s) - 1 chunk-0 forwards; s pairs (chunk-1 forward, chunk-0 forward); p - s
    chunk-1 (F, B, W). Steady state: (F, B, W) of chunk 0, then of chunk 1. Cool-down: s pairs
    of B (chunk 0, chunk 1), p - s chunk-0 (B, W), then the W's left, chunk 1's first. At its
    peak every stage holds 2p chunks' forwards (p micro-batches of the stage, as 1F1B's first
    stage), and at F = B = W and m >= 2p - 1 no stage waits in the steady state."""
    p, s = stages, stage
    n = max(micro_batches, 2 * p - 1)
    counts = dict.fromkeys(
        ((kind, chunk) for kind in (FORWARD, BACKWARD, WEIGHT) for chunk in (0, 1)), 0
    )
    sequence: list[tuple[int, int, int]] = []

    def run(*ops: tuple[int, int]) -> None:
        for kind, chunk in ops:  # each (kind, chunk) on its next micro-batch
            sequence.append((kind, chunk, counts[(kind, chunk)]))
            counts[(kind, chunk)] += 1

    f0, f1, b0, b1, w0, w1 = ((k, c) for k in (FORWARD, BACKWARD, WEIGHT) for c in (0, 1))
    run(*[f0] * (2 * (p - s) - 1))  # warm-up
    run(*[f1, f0] * s)
    run(*[f1, b1, w1] * (p - s))
    while counts[f1] < n:  # steady state
        run(*([f0] if counts[f0] < n else []), b0, w0, f1, b1, w1)
    run(*[b0, b1] * s)  # cool-down
    run(*[b0, w0] * (p - s))
    run(*[w1] * (n - counts[w1]), *[w0] * (n - counts[w0]))
    return [op for op in sequence if op[2] < micro_batches]


def interleaved_sequence(
    stage: int, stages: int, chunks: int, micro_batches: int
) -> list[tuple[int, int, int]]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): the (kind, chunk, micro-batch)
    operations of ``stage`` of ``stages``, which holds ``chunks`` chunks of layers: its chunk c
    is the model's chunk c x stages + stage, so a micro-batch passes every stage ``chunks`` times
    and the pipeline's bubble shrinks about ``chunks``-fold. With chunks = 1, plain 1F1B."""
    return list(interleaved_orders(stages, chunks, micro_batches)[stage])


def micro_batch_groups(stages: int, micro_batches: int) -> list[int]:
    """The sizes of interleaved 1F1B's groups of micro-batches, in order: as many groups as
    whole groups of ``stages`` fit (one at least), the micro-batches left over spread one
    each over the first groups (31 over 9 stages: 11, 10, 10). No group is shorter than the
    pipeline (but where all the micro-batches are), so a micro-batch's next chunk is ready when
    the stage has run the group through the chunk before; the largest group comes first, so the
    warm-up that covers it covers every group (interleaved_warmup)."""
    count = max(1, micro_batches // stages)
    size, left_over = divmod(micro_batches, count)
    return [size + 1] * left_over + [size] * (count - left_over)


def interleaved_warmup(stage: int, stages: int, chunks: int, micro_batches: int) -> int:
    """Chunk forwards ``stage`` runs before its first backward under interleaved 1F1B:
    Megatron-LM's 2 (p - s - 1) + (v - 1) g, its group size g being the first (largest)
    group's. The last stage runs a micro-batch's last-chunk backward (v - 1) g places after its
    first-chunk forward in the forward order, so it needs (v - 1) g forwards ahead; each stage
    before it 2 more, for the activation's way to the last stage and the gradient's way back.
    With one chunk, plain 1F1B's p - s - 1."""
    p, v, m = stages, chunks, micro_batches
    if v == 1:
        return min(p - stage - 1, m)
    group = micro_batch_groups(p, m)[0]
    return min(2 * (p - stage - 1) + (v - 1) * group, m * v)


@memoized
def interleaved_orders(
    stages: int, chunks: int, micro_batches: int
) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Every stage's interleaved 1F1B order (see interleaved_sequence).

    Forwards go in groups of micro-batches (micro_batch_groups), chunk by chunk inside a group
    (micro-batches 0..g-1 through chunk 0, then through chunk 1, ...); backwards go in the same
    order with the chunks reversed. Every stage runs them in the same order, so the sends
    between two stages need no tags. A stage runs its warm-up's forwards first
    (interleaved_warmup), then alternates one forward and one backward, then runs the
    backwards left.

    Any micro-batch count runs without a cliff in the bubble. Megatron-LM's groups are p
    micro-batches and the last one short: then a stage waits for a micro-batch's next chunk
    (p - r forwards of its group are missing, r the short group's size), and a fixed warm-up
    deadlocks there (p = 8, v = 2, m = 10). Groups of at least p micro-batches, the larger
    first, are torch's ScheduleInterleaved1F1B's rounds made uneven: at uniform costs the
    bubble is the ideal (p - 1) / (v m) of the work for any m >= p, for the memory of a
    first group g instead of p ((v - 1)(g - p) chunk forwards more in flight).
    """
    p, v, m = stages, chunks, micro_batches
    order = []  # (chunk, micro-batch) in the forward order
    first = 0
    for size in micro_batch_groups(p, m):
        order += [(c, j) for c in range(v) for j in range(first, first + size)]
        first += size
    forwards = [(FORWARD, c, j) for c, j in order]
    backwards = [(BACKWARD, v - 1 - c, j) for c, j in order]

    def sequence(warmup: int) -> tuple[tuple[int, int, int], ...]:
        steady = [op for k in range(m * v - warmup) for op in (forwards[warmup + k], backwards[k])]
        return tuple(forwards[:warmup] + steady + backwards[m * v - warmup :])

    return tuple(sequence(interleaved_warmup(s, p, v, m)) for s in range(p))


def run_in_dependency_order(
    orders: Sequence[Sequence[tuple[int, int, int]]],
    stages: int,
    chunks: int,
    micro_batches: int,
    ran: list[tuple[int, int, int, int]] | None = None,
    schedule: Schedule = Schedule.INTERLEAVED_1F1B,
) -> list[int]:
    """Run every stage's order (of (kind, chunk, micro-batch) operations) as a whole pipeline
    runs it, sends never blocking (the runtime's isend): stage after stage, each as far as its
    next operation's inputs allow, until nothing can run. Stage s's chunk c is the model's
    model_chunk(schedule, s, stages, c); a forward of model chunk g waits for chunk g - 1's
    forward of its micro-batch, a backward for its own forward and chunk g + 1's backward, a
    WEIGHT for its own backward (on its own stage; so is the V's turn from chunk p - 1 to p).
    Each operation run is appended to ``ran``, if given, as (stage, kind, chunk, micro-batch):
    an order where every dependency comes first. Returns where each stage stopped (the length
    of its order when it ran everything)."""
    p, v, m = stages, chunks, micro_batches
    last = p * v - 1
    model = stage_model_chunks(schedule, p, v)
    done = bytearray(3 * p * v * m)  # (kind, model chunk, micro-batch) -> ran
    position = [0] * p
    progress = True
    while progress:
        progress = False
        for s, order in enumerate(orders):
            at, end = position[s], len(order)
            while at < end:
                kind, chunk, j = order[at]
                g = model[s][chunk]
                if kind == FORWARD:
                    ready = g == 0 or done[(g - 1) * m + j]
                elif kind == BACKWARD:
                    ready = done[g * m + j] and (g == last or done[(p * v + g + 1) * m + j])
                else:
                    ready = done[(p * v + g) * m + j]
                if not ready:
                    break
                done[(kind * p * v + g) * m + j] = 1
                if ran is not None:
                    ran.append((s, kind, chunk, j))
                at += 1
            if at != position[s]:
                position[s], progress = at, True
    return position
