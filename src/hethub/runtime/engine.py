"""One rank's part of a training step: the coordinator of its rooms.

The engine builds this rank's stage (runtime.model), its fp32 view of the weights
(runtime.precision), its groups (runtime.process_groups) and its optimizer (runtime.optimizer),
then each step runs the pipeline schedule and its sends (runtime.pipeline, runtime.p2p), the
gradient sync (runtime.grad_sync) and the optimizer. Every collective goes through the
communicator (hethub.comm), which counts its bytes.

Every step records this rank's measured timeline (``Engine.timeline``): its forward and backward
operations, the waits in receives, the gradient sync and the optimizer, in seconds from the
step's start (a barrier, so the ranks' timelines line up).

The host reads from the device once a step, when the step is over: this rank's share of the loss
(summed on the device over the micro-batches), the global gradient norm where it is tracked or
clipped (runtime.grad_norm) and, when asked, the largest weight, finite only if every weight is.
Until then it only queues work, so an accelerator never waits on the host between micro-batches;
the timeline's device events are read after it too.

The recipe: the rate of each step is the caller's (runtime.lr_schedule), AdamW's weight decay
spares norms and biases (runtime.optimizer), and the gradients are clipped by their global norm
after the sync and before the step. The constructor's defaults are a constant rate, no decay and
no clipping; `hethub train`'s are its RunSettings'.

``evaluate`` runs windows forward only through the same pipeline, for a validation loss.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
from torch.nn.utils import get_total_norm

from hethub.comm import Communicator
from hethub.errors import HethubError
from hethub.report.timeline import TimelineEvent
from hethub.runtime.compiled import compile_layers
from hethub.runtime.grad_norm import GlobalGradNorm, clip_, counted_spans
from hethub.runtime.grad_sync import Bucket, GradientSync, sync_buckets
from hethub.runtime.model import Stage, StageChunks
from hethub.runtime.optimizer import PlainAdamW, ShardedAdamW
from hethub.runtime.p2p import StageLinks
from hethub.runtime.param_gather import ForwardWaits
from hethub.runtime.pipeline import Pipeline
from hethub.runtime.precision import MasterWeights
from hethub.runtime.process_groups import RankGroups, create_job_groups
from hethub.runtime.rundir import DEFAULT_SETTINGS
from hethub.runtime.timeline import StepTimeline
from hethub.spec.buckets import BUCKET_BYTES, rank_buckets
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import parameter_table
from hethub.spec.plan import Plan
from hethub.spec.topology import Topology


class Engine:
    """Builds this rank's stage, groups, sync and optimizer; ``step`` trains on one global
    batch."""

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
        clip_grad: float = 0.0,
        track_grad_norm: bool = False,
        device: torch.device | None = None,
        speed: float | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        """``groups``: this rank's groups of the job (process_groups.create_job_groups);
        ``lr``: the rate of every step that is given none; ``weight_decay``: AdamW's, on every
        parameter but norms and biases; ``clip_grad``: the global gradient norm is clipped to
        it (0: not clipped); ``track_grad_norm``: the norm is computed (``grad_norm``) even
        unclipped; ``device``: where this rank runs (default: the CPU); ``speed``: this rank's
        emulated speed relative to the machine (None: as fast as it runs); ``bucket_bytes``:
        the gradient sync's bucket cap (spec.buckets)."""
        self.plan, self.topology, self.spec, self.comm = plan, topology, spec, comm
        self.groups = groups
        self.rank = comm.rank
        self.me = topology.ranks[self.rank]
        self.device = device or torch.device("cpu")
        self.parameter_table = parameter_table(spec)
        self.stage = self._build_stage(seed)
        # The ranks holding exactly this rank's shards (their group: groups.data, when used).
        self.peers = topology.data_parallel_peers(self.rank)
        held = rank_buckets(
            topology, spec, self.rank, peers_have_a_group=groups.data is not None, cap=bucket_bytes
        )
        sharded = plan.shard_optimizer and groups.data is not None
        shards = groups.data.size if sharded else 1
        # What the optimizer, the gradient sync and checkpoints see: fp32 weights in either
        # precision (runtime.precision), in flat buffers laid out by the sync's buckets.
        self.weights = MasterWeights(self.stage, plan.precision, [b.names for b in held], shards)
        compile_layers(self.stage, plan)  # after the weights are placed: runtime.compiled
        self.sharded = sharded
        self.param_waits: ForwardWaits | None = None
        """With an overlapped param gather: the forward hooks that wait for it."""
        self.optimizer = self._build_optimizer(lr, weight_decay)
        self.sync = GradientSync(
            sync_buckets(held, self.weights),
            self.weights,
            comm,
            groups,
            self.parameter_table,
            sharded=self.optimizer if self.sharded else None,
            overlap=self.stage if plan.overlap_grad_sync else None,
        )
        self._timeline = StepTimeline(self.me, self.device)
        self.pipeline = self._build_pipeline(speed)
        self.clip_grad = clip_grad
        self.grad_norm_of = self._build_grad_norm() if clip_grad > 0 or track_grad_norm else None
        """Where the norm is tracked or clipped: this rank's counted gradients."""
        self._norm: torch.Tensor | None = None  # the last sync's global norm, on the device
        self.grad_norm: float | None = None
        """The global gradient norm of the last step, before clipping (None where neither
        tracked nor clipped)."""
        self.own_loss = 0.0
        """This rank's share of the last step's loss (0 off the last stage's leaders): which
        rank's went non-finite is what a run stopped on a NaN reports."""
        self.weights_finite: bool | None = None
        """Whether every weight of this rank was finite after the last step, where it asked
        (``step(check_weights=True)``); None where it did not."""

    def _build_stage(self, seed: int) -> StageChunks:
        """One Stage per model chunk this rank holds (interleaved 1F1B: several), its TP shard
        of the seeded initial weights on this rank's device."""
        chunks = [
            Stage.build(
                self.spec,
                chunk.first_layer,
                chunk.layers,
                self.groups.tp.handle,
                is_first=chunk.is_first,
                is_last=chunk.is_last,
                seed=seed,
                device=self.device,
                sequence_parallel=self.plan.sequence_parallel,
            )
            for chunk in self.me.chunks
        ]
        return StageChunks(chunks)

    def _build_optimizer(self, lr: float, weight_decay: float) -> PlainAdamW | ShardedAdamW:
        """AdamW over this rank's weights, or over its shard of them among its data-parallel
        peers (``self.sharded``), with the forward hooks that wait for an overlapped weight
        gather (``self.param_waits``)."""
        if not self.sharded:
            return PlainAdamW(self.weights, lr, weight_decay)
        optimizer = ShardedAdamW(
            self.weights,
            self.groups.data,
            lr,
            weight_decay,
            self.comm,
            overlap_gather=self.plan.overlap_param_gather,
        )
        if self.plan.overlap_param_gather:
            self.param_waits = ForwardWaits(self.stage, optimizer)
        return optimizer

    def _build_pipeline(self, speed: float | None) -> Pipeline:
        """This rank's schedule over its stage, with its links to its neighbouring stages'
        TP ranks (runtime.p2p)."""
        links = StageLinks(
            self.comm,
            self.groups,
            self.device,
            self.weights.compute_dtype,
            self.plan.sequence_parallel,
        )
        return Pipeline(
            self.plan,
            self.topology,
            self.spec,
            self.rank,
            self.stage,
            links,
            timeline=self._timeline,
            device=self.device,
            speed=speed,
        )

    def _build_grad_norm(self) -> GlobalGradNorm:
        """The global gradient norm over the gradients this rank counts (its shard's, under a
        sharded optimizer; each tensor once over its holders: grad_norm.counted_spans)."""
        shard = self.optimizer.index if self.sharded else None
        spans = counted_spans(self.topology, self.spec, self.rank, self.weights.layout, shard)
        counted = [self.weights.main_grads[start:stop] for start, stop in spans]
        return GlobalGradNorm(counted, self.device, self.comm, self.groups.world)

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

    @property
    def timeline(self) -> list[TimelineEvent]:
        """This rank's measured events of the last step."""
        return self._timeline.events

    @property
    def sync_buckets(self) -> list[Bucket]:
        """The gradient sync's buckets, in the order it runs them."""
        return self.sync.buckets

    @property
    def overlapped_buckets(self) -> int:
        """How many buckets the last step started summing during its backwards (one synced
        through the stage leaders: its part inside the vendor)."""
        return self.sync.overlapped_buckets

    def step(
        self, tokens: torch.Tensor, *, lr: float | None = None, check_weights: bool = False
    ) -> float:
        """One optimizer step at rate ``lr`` (None: the last one) on the global batch ``tokens``
        (sequences, seq_len + 1); the mean loss. With ``check_weights``, also whether the
        updated weights are all finite (``weights_finite``), read with the loss."""
        loss = self._forward_backward(tokens)
        with self._timeline.timed("optimizer"):
            self.update(lr)
        return self._end_step(loss, check_weights)

    def update(self, lr: float | None = None) -> None:
        """The optimizer step at rate ``lr`` (None: the last one) on the synced gradients
        (``gradients``), clipped by their global norm where asked; the stage then computes
        with the new weights (with an overlapped param gather, each module once its gather is
        done, waited for just before its first forward)."""
        if self.clip_grad > 0:
            clip_(self.optimizer.stepped_grads, self._norm, self.clip_grad)
        self.optimizer.step(lr)
        if self.param_waits is not None:
            self.param_waits.arm()

    def finish_param_gather(self) -> None:
        """Every weight of the stage is up to date once this returns: an overlapped param
        gather still under way is waited for (what reads the weights outside a step's forwards,
        a check, a checkpoint or an evaluation, calls it; the sharded optimizer's own state
        readers wait by themselves)."""
        if self.param_waits is not None:
            self.param_waits.disarm()
            self.optimizer.finish_gathers()

    def gradients(self, tokens: torch.Tensor) -> float:
        """Forward and backward of the global batch and the gradient sync, without the update:
        afterwards every parameter's .grad is its share of the global batch's gradient (a
        sharded optimizer holds its slice); the mean loss."""
        return self._end_step(self._forward_backward(tokens), check_weights=False)

    def evaluate(self, tokens: torch.Tensor) -> float:
        """Collective, forward only: the mean next-token loss of the windows ``tokens``
        (n, seq_len + 1), each window's first seq_len tokens the input and its last seq_len the
        targets, under this engine's plan (runtime.pipeline.Pipeline.evaluate); the same on
        every rank. Its messages are not counted as the training step's traffic."""
        windows, width = tokens.shape
        if windows == 0 or width != self.spec.seq_len + 1:
            raise HethubError(
                f"evaluation windows of shape {tuple(tokens.shape)}: want at least one window "
                f"of seq_len + 1 = {self.spec.seq_len + 1} tokens"
            )
        self.finish_param_gather()
        with self.comm.not_counted():
            own = self.pipeline.evaluate(tokens).to("cpu", copy=True).double().reshape(1)
            self.comm.all_reduce(own, self.groups.world)
        return own.item() / (windows * self.spec.seq_len)

    def weights_are_finite(self) -> bool:
        """Whether every weight of this rank is finite now: a read of its own, outside a step."""
        self.finish_param_gather()
        return math.isfinite(self._largest_weight().item())

    def _forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The schedule and the gradient sync, queued without reading the device; this rank's
        share of the loss, on the device."""
        self.comm.barrier()  # every rank's timeline starts together
        self._timeline.start()
        self.sync.start_step()
        loss = self.pipeline.run(tokens, before_last_backward=self.sync.arm)
        if self.param_waits is not None:  # every module's first forward has waited
            self.param_waits.disarm()
        with self._timeline.timed("grad_sync"):
            self.sync.run()
            if self.grad_norm_of is not None:
                self._norm = self.grad_norm_of.compute()
        return loss

    def _end_step(self, loss: torch.Tensor, check_weights: bool) -> float:
        """The step's one read of the device (``loss``, this rank's share, the global gradient
        norm where there is one, and when asked the largest weight), then the mean loss, summed
        over the ranks on the host."""
        if check_weights:
            self.finish_param_gather()
        values = [loss]
        if self._norm is not None:
            values.append(self._norm)
        if check_weights:
            values.append(self._largest_weight())
        # The host waits for the device here. A copy on the CPU too: there it costs nothing, and
        # a count of the dispatched operations sees the read as it would on an accelerator.
        read = (torch.stack(values) if len(values) > 1 else loss.reshape(1)).to("cpu", copy=True)
        own, *others = read.tolist()
        self.own_loss = own
        self.grad_norm = others.pop(0) if self._norm is not None else None
        self.weights_finite = math.isfinite(others[0]) if check_weights else None
        reported = read[:1]
        with self.comm.not_counted():  # a report, not training traffic
            self.comm.all_reduce(reported, self.groups.world)
        return reported.tolist()[0]

    def _largest_weight(self) -> torch.Tensor:
        """The largest magnitude among the weights the stage computes with (whichever optimizer
        wrote them), on the device: finite only if every weight is, as NaN wins a maximum."""
        return get_total_norm(list(self.stage.parameters()), math.inf).float()

    def gather_full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full-model tensor of parameter ``name`` (full-model name) from this stage's TP
        shards of it (a weight, an optimizer moment, a gradient): a collective of the TP group,
        outside the step's counted traffic (a checkpoint's)."""
        self.finish_param_gather()
        with self.comm.not_counted():
            return self.sync.gather_full(name, tensor)
