"""One rank's part of a training step: its stage of the pipeline schedule, the sends between
stages, the gradient sync with every rank that holds the same parameters, and the optimizer.

Exactness by construction: every micro-batch's loss is scaled by 1 / (micro-batches in the global
batch), so summing gradients over micro-batches and replicas gives the gradient of the mean
token loss over the global batch, whatever the split between unlike replicas.

Every step records this rank's measured timeline (``Engine.timeline``): its forward and backward
operations, the waits in receives, the gradient sync and the optimizer, in seconds from the
step's start (a barrier, so the ranks' timelines line up). A group with an emulated ``speed``
(a fraction of this machine's speed, for local runs) has every forward and backward stretched
by sleeping (1 / speed - 1) times its measured duration.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from hethub.comm import Communicator, Pending
from hethub.report.timeline import TimelineEvent
from hethub.runtime.model import Stage, StageChunks, shard
from hethub.runtime.optimizer import PlainAdamW, ShardedAdamW
from hethub.runtime.precision import MasterWeights
from hethub.runtime.process_groups import RankGroups, SyncGroups, create_job_groups
from hethub.runtime.rundir import DEFAULT_SETTINGS
from hethub.spec.buckets import BUCKET_BYTES, rank_buckets
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import parameter_table
from hethub.spec.plan import Plan, Recompute
from hethub.spec.schedules import BACKWARD, FORWARD, chunk_sequence
from hethub.spec.topology import Topology


class Engine:
    """Builds this rank's stage and process groups; ``step`` trains on one global batch."""

    def __init__(
        self,
        plan: Plan,
        topology: Topology,
        spec: ModelSpec,
        comm: Communicator,
        groups: RankGroups,
        *,
        seed: int,
        lr: float = DEFAULT_SETTINGS.lr,
        weight_decay: float = 0.0,
        device: torch.device | None = None,
        speed: float | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        """``groups``: this rank's groups (process_groups.create_job_groups); ``device``: where
        this rank runs (default: the CPU); ``speed``: this rank's emulated speed
        relative to the machine (None: as fast as it runs); ``bucket_bytes``: the gradient sync's
        bucket cap (spec.buckets)."""
        self.plan, self.topology, self.spec, self.comm = plan, topology, spec, comm
        self.groups = groups
        self.stretch = 1.0 / speed - 1.0 if speed else 0.0
        self.bucket_bytes = bucket_bytes
        self.timeline: list[TimelineEvent] = []
        self._step_start = 0.0
        self.rank = comm.rank
        self.me = topology.ranks[self.rank]
        self.device = device or torch.device("cpu")
        self.parameter_table = parameter_table(spec)
        self.my_tp_ranks = groups.tp.ranks
        self.leader = groups.leader
        self.tp_group = groups.tp.handle
        # One Stage per model chunk this rank holds (interleaved 1F1B: several).
        self.stage = StageChunks(
            [
                Stage.build(
                    spec,
                    chunk.first_layer,
                    chunk.layers,
                    self.tp_group,
                    is_first=chunk.is_first,
                    is_last=chunk.is_last,
                    seed=seed,
                    device=self.device,
                )
                for chunk in self.me.chunks
            ]
        )
        # What the optimizer, the gradient sync and checkpoints see: fp32 weights in either
        # precision (runtime.precision).
        self.weights = MasterWeights(self.stage, plan.precision)
        # The ranks holding exactly this rank's shards, in a group of their own when a sharded
        # optimizer or an overlapped sync needs one.
        self.peers = topology.data_parallel_peers(self.rank)
        self.peer_group = groups.data
        self.sync_buckets = self._sync_buckets(groups)
        if plan.shard_optimizer and len(self.peers) > 1:
            self.optimizer = ShardedAdamW(
                self.weights,
                [bucket.params for bucket in self.sync_buckets],
                self.peer_group,
                lr,
                weight_decay,
                self.comm,
            )
        else:
            self.optimizer = PlainAdamW(self.weights, lr, weight_decay)
        self.sharded = isinstance(self.optimizer, ShardedAdamW)
        self._in_flight: dict[int, tuple] = {}  # bucket -> its overlapped sync, launched
        self.overlapped_buckets = 0  # of the last step: synced during its backwards
        if plan.overlap_grad_sync:
            self._hook_overlap()
        # On a stage leader: the pipeline neighbours' leaders, and the group each pair talks
        # through: a group per ordered pair, which carries the sender's activations one way and
        # their gradients back, each in the order both ends run them. Interleaving adds the pair
        # from the last stage to the first (between a micro-batch's rounds of chunks).
        prev, following = groups.pipeline_prev, groups.pipeline_next
        self.prev_leader, self.prev_group = (prev.ranks[0], prev) if prev else (None, None)
        self.next_leader, self.next_group = (
            (following.ranks[1], following) if following else (None, None)
        )

    @classmethod
    def for_job(
        cls,
        plan: Plan,
        topology: Topology,
        spec: ModelSpec,
        cluster: ClusterSpec,
        *,
        device: torch.device | None = None,
        timeout: timedelta | None = None,
        **kwargs,
    ) -> Engine:
        """Collective: this rank's engine on ``device`` (default: the CPU) with its communicator
        (whose messages wait at most ``timeout``) and the job's process groups (created here,
        on every rank alike); ``kwargs`` as for the constructor."""
        device = device or torch.device("cpu")
        groups = create_job_groups(
            topology, spec, cluster, device, plan.shard_optimizer or plan.overlap_grad_sync
        )
        return cls(
            plan,
            topology,
            spec,
            Communicator(topology.vendors(cluster), timeout),
            groups,
            device=device,
            **kwargs,
        )

    def step(self, tokens: torch.Tensor) -> float:
        """One optimizer step on the global batch ``tokens`` (sequences, seq_len + 1); the mean
        loss."""
        loss = self.gradients(tokens)
        with self._timed("optimizer"):
            self.update()
        return loss

    def update(self) -> None:
        """The optimizer step on the synced gradients (``gradients``); the stage then computes
        with the new weights."""
        self.optimizer.step()

    def gradients(self, tokens: torch.Tensor) -> float:
        """Forward and backward of the global batch and the gradient sync, without the update:
        afterwards every parameter's .grad is its share of the global batch's gradient."""
        self.comm.barrier()  # every rank's timeline starts together
        self._step_start, self.timeline = time.perf_counter(), []
        total = sum(p.count * p.micro_batches for p in self.plan.pipelines)
        loss_sum = self._run_schedule(self._my_micro_batches(tokens), total)
        # This rank's share of the loss (0 off the last stage's leaders): which rank's went
        # non-finite is what a run stopped on a NaN reports.
        self.own_loss = loss_sum
        with self._timed("grad_sync"):
            self._sync_gradients()
            reported = torch.tensor([loss_sum])
            with self.comm.not_counted():  # a report, not training traffic
                self.comm.all_reduce(reported, self.groups.world)  # only last-stage leaders add
        return reported.item()

    @contextmanager
    def _timed(
        self, kind: str, micro_batch: int | None = None, stretch: bool = False
    ) -> Iterator[None]:
        """Record the enclosed work as one timeline event; with ``stretch``, then sleep the
        emulated slowdown."""
        start = time.perf_counter()
        yield
        if stretch and self.stretch:
            time.sleep(self.stretch * (time.perf_counter() - start))
        self.timeline.append(
            TimelineEvent(
                pipeline=self.me.pipeline,
                stage=self.me.stage,
                group=self.me.group,
                micro_batch=micro_batch,
                kind=kind,
                start_s=start - self._step_start,
                end_s=time.perf_counter() - self._step_start,
                source="measured",
            )
        )

    def _my_micro_batches(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """This replica's micro-batches: replicas take consecutive slices of the global batch."""
        b = self.plan.micro_batch
        per_replica = {r.replica: r.micro_batches for r in self.topology.ranks}
        start = sum(per_replica[r] for r in range(self.me.replica)) * b
        return [
            tokens[start + j * b : start + (j + 1) * b].to(self.device)
            for j in range(self.me.micro_batches)
        ]

    def _run_schedule(self, micro: list[torch.Tensor], total: int) -> float:
        """This stage's operations in its schedule's order (spec.schedules.chunk_sequence):
        each forward and backward of one micro-batch through one of its chunks."""
        stages = self.topology.replica_stages(self.me.replica)
        b, t, h = self.plan.micro_batch, self.spec.seq_len, self.spec.hidden
        chunks = self.me.chunks
        inputs, outputs, sends, loss_sum = {}, {}, [], 0.0
        order = chunk_sequence(self.plan.schedule, self.me.stage, stages, len(chunks), len(micro))
        last_backward = {c: i for i, (kind, c, _) in enumerate(order) if kind == BACKWARD}
        if self.plan.overlap_grad_sync:
            self._armed.clear()
            self._waiting = {
                index: len(bucket.params)
                for index, bucket in enumerate(self.sync_buckets)
                if bucket.direct
            }
        for i, (kind, c, j) in enumerate(order):
            chunk, key = chunks[c], (c, j)
            if self.plan.overlap_grad_sync and i == last_backward[c]:
                self._armed.add(c)  # this backward gives the chunk's gradients their last part
            if kind == FORWARD:
                if chunk.is_first:
                    x = micro[j][:, :-1]
                else:
                    x = self._receive((b, t, h), True, j).requires_grad_()
                with self._timed("forward", j, stretch=True):
                    out = self._forward(c, x)
                    if chunk.is_last:
                        outputs[key] = self.stage.chunks[c].loss(out, micro[j][:, 1:]) / total
                if chunk.is_last:
                    if self.rank == self.leader:
                        loss_sum += outputs[key].item()
                else:
                    outputs[key] = out
                    sends += self._send(out.detach(), True)
                inputs[key] = x
            else:
                grad = None if chunk.is_last else self._receive((b, t, h), False, j)
                with self._timed("backward", j, stretch=True):
                    outputs[key].backward(grad)
                if not chunk.is_first:
                    sends += self._send(inputs[key].grad, False)
                del inputs[key], outputs[key]
        with self._timed("send_wait"):
            for work in sends:
                self.comm.wait(work)
        return loss_sum

    def _forward(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        module = self.stage.chunks[chunk]
        if self.plan.recompute is Recompute.FULL:
            return checkpoint(module, x, use_reentrant=False)
        return module(x)

    def _send(self, tensor: torch.Tensor, forward: bool) -> list:
        """Send an activation to the next stage (``forward``) or its gradient to the previous.
        Activations and their gradients are whole on every TP rank of a stage, so the stage
        leaders exchange them (whatever the two stages' TP degrees) and the receiving leader
        broadcasts to its TP group. Each direction has its own group, so that with two stages
        interleaved (the previous and the next stage one rank) activations and gradients never
        cross."""
        if self.rank != self.leader:
            return []
        peer, group = (
            (self.next_leader, self.next_group) if forward else (self.prev_leader, self.prev_group)
        )
        return [self.comm.isend(tensor.contiguous(), peer, group)]

    def _receive(self, shape: tuple[int, ...], forward: bool, micro_batch: int) -> torch.Tensor:
        """Receive an activation from the previous stage (``forward``) or a gradient from the
        next. The wait covers the peer's compute still to come and the transfer: a receive
        cannot tell them apart, so the timeline calls it a wait."""
        buffer = torch.empty(shape, device=self.device, dtype=self.weights.compute_dtype)
        with self._timed("recv_wait", micro_batch):
            if self.rank == self.leader:
                peer, group = (
                    (self.prev_leader, self.prev_group)
                    if forward
                    else (self.next_leader, self.next_group)
                )
                self.comm.recv(buffer, peer, group)
            self.comm.broadcast(buffer, self.leader, self.groups.tp)
        return buffer

    def _sync_buckets(self, groups: RankGroups) -> list[Bucket]:
        """The gradient sync's buckets (spec.buckets.rank_buckets, which the predictor prices
        too), fixed for the engine's life: its parameters are updated in place."""
        buckets = []
        for bucket in rank_buckets(
            self.topology,
            self.spec,
            self.rank,
            peers_have_a_group=self.peer_group is not None,
            cap=self.bucket_bytes,
        ):
            # Only the leaders reduce; the other TP ranks take part in gather and broadcast.
            sync = groups.grad_sync[bucket.holders] if self.rank == self.leader else None
            params = [(name, self.weights.by_name[name]) for name in bucket.names]
            buckets.append(Bucket(params, sync, bucket.direct))
        return buckets

    def _sync_gradients(self) -> None:
        """Sum each parameter's gradient over every replica (and the tied head copy) holding it,
        bucket by bucket (_sync_buckets): among the data-parallel peers directly where they are
        its only holders and a sharded optimizer or an overlapped sync asked for their group
        (_sync_direct; an overlapped one was launched during the backwards), else by gathering
        each full gradient in the TP group, flattening the bucket, all-reducing it among the
        holders' leaders, broadcasting it back and keeping this rank's shards (_sync_bucket).
        A sharded optimizer then gets this rank's slice of each bucket."""
        self.overlapped_buckets = len(self._in_flight)  # launched during the backwards
        for index, bucket in enumerate(self.sync_buckets):
            if bucket.direct:
                started = self._in_flight.pop(index, None)
                pending = started if started is not None else self._sync_direct(bucket)
                self._finish_direct(index, bucket, pending.wait())
                continue
            self._sync_bucket(bucket)
            if self.sharded:
                flat = torch.cat([param.grad.reshape(-1) for _, param in bucket.params])
                self.optimizer.set_grad(index, self.optimizer.my_slice(self.optimizer.pad(flat)))

    def _sync_direct(self, bucket: Bucket) -> Pending:
        """Start summing ``bucket`` among the data-parallel peers, each its own shards: a
        reduce-scatter to this rank's slice for a sharded optimizer, else an all-reduce."""
        flat = torch.cat([param.grad.reshape(-1) for _, param in bucket.params])
        if self.sharded:
            return self.comm.start_reduce_scatter(self.optimizer.pad(flat), self.peer_group)
        return self.comm.start_all_reduce(flat, self.peer_group)

    def _finish_direct(self, index: int, bucket: Bucket, result: torch.Tensor) -> None:
        if self.sharded:
            self.optimizer.set_grad(index, result)
            return
        sizes = [param.numel() for _, param in bucket.params]
        for (_, param), piece in zip(bucket.params, result.split(sizes), strict=True):
            param.grad.copy_(piece.view_as(param))

    def _hook_overlap(self) -> None:
        """An overlapped sync: each direct bucket's sum starts (_sync_direct, asynchronously)
        once every one of its parameters has had its last gradient of the step, which the last
        backward of its chunk gives it (_run_schedule arms the chunk before that backward).
        The hooks run after AccumulateGrad (and after bf16's main-gradient hook, registered
        first), in the backward's deterministic order, so the peers, which run the same chunks
        in the same order, launch their collectives in the same order."""
        bucket_of = {
            id(param): index
            for index, bucket in enumerate(self.sync_buckets)
            if bucket.direct
            for _, param in bucket.params
        }
        self._armed: set[int] = set()
        self._waiting: dict[int, int] = {}
        for c, chunk in enumerate(self.stage.chunks):
            for name, computed in chunk.full_parameters():
                index = bucket_of.get(id(self.weights.by_name[name]))
                if index is not None:
                    computed.register_post_accumulate_grad_hook(self._ready_hook(c, index))

    def _ready_hook(self, chunk: int, index: int):
        def hook(_: torch.Tensor) -> None:
            if chunk not in self._armed:
                return
            self._waiting[index] -= 1
            if not self._waiting[index]:
                self._in_flight[index] = self._sync_direct(self.sync_buckets[index])

        return hook

    def _sync_bucket(self, bucket: Bucket) -> None:
        """One bucket's sync: the full gradients flattened into one buffer, one all-reduce, one
        broadcast."""
        tp, tp_rank = len(self.my_tp_ranks), self.me.tp_rank
        fulls = [self._gather_full(name, param.grad) for name, param in bucket.params]
        flat = torch.cat([full.reshape(-1) for full in fulls])
        if bucket.sync is not None:  # this rank leads its stage
            sync = bucket.sync
            if sync.bridge is not None:
                self.comm.hierarchical_all_reduce(flat, sync.local, sync.bridge)
            else:
                self.comm.all_reduce(flat, sync.local)
        self.comm.broadcast(flat, self.leader, self.groups.tp)
        pieces = flat.split([full.numel() for full in fulls])
        for (name, param), piece, full in zip(bucket.params, pieces, fulls, strict=True):
            param.grad.copy_(shard(self.parameter_table[name], piece.view_as(full), tp_rank, tp))

    def gather_full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full-model tensor of parameter ``name`` (full-model name) from this stage's TP
        shards of it (a weight, an optimizer moment, a gradient): a collective of the TP group,
        outside the step's counted traffic (a checkpoint's)."""
        with self.comm.not_counted():
            return self._gather_full(name, tensor)

    def _gather_full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        dim = self.parameter_table[name].tp_dim
        if dim is None:
            return tensor.clone()
        return self.comm.all_gather(tensor, self.groups.tp, dim)


class Bucket(NamedTuple):
    """Gradients synced as one flat buffer among the leaders holding them."""

    params: list[tuple[str, torch.nn.Parameter]]
    sync: SyncGroups | None
    """The groups that sum it (RankGroups.grad_sync); None on a rank that does not lead its
    stage: it only gathers and receives."""
    direct: bool = False
    """Summed among the data-parallel peers, each TP rank its own shards (Engine._sync_direct)."""
