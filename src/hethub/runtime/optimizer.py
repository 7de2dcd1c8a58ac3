"""The optimizer of one rank: AdamW over its trained parameters, whole or sharded.

Both step flat buffers (runtime.precision, runtime.flat_layout), not tensor by tensor: the plain
one the rank's whole fp32 buffer (AdamW is elementwise, so stepping a flat buffer is stepping
its parameters), the sharded one this rank's shard of each bucket; with torch's fused AdamW
where the device has it (one kernel a step), else its foreach implementation.

Sharded (a plan's ``shard_optimizer``; Megatron's distributed optimizer, ZeRO-1): the d ranks
holding exactly the same parameter shards (Topology.data_parallel_peers: the same stage and TP
rank of every replica of identical layouts) each keep 1/d of the optimizer state. Each gradient
bucket (runtime.grad_sync) is one slice of the flat buffers, padded to a multiple of d; rank i
of the d owns its i-th shard: the two Adam moments of the shard and, in bf16, its fp32 master
weights. In fp32 the shard of the weights themselves is stepped in place, no copy of it kept
(as Megatron-LM's distributed optimizer does). After the step the d ranks all-gather the
updated shards, in the dtype the stage computes in, into its weights' buffer: at once, or, with an
overlapped gather (a plan's ``overlap_param_gather``, Megatron-LM's ``overlap_param_gather``),
started asynchronously bucket by bucket and waited for just before the next forward that reads
a bucket's weights (runtime.param_gather), and before anything else reads or writes the weights
or the state (a checkpoint, a load, the gradients). In bf16 the full
fp32 masters are then dropped, so a parameter costs 2 (bf16 weight) + 4 (main grad) + 12 / d
bytes; in fp32, 4 (weight) + 4 (grad) + 8 / d (moments).

Both kinds read and write their state as full local tensors by full-model name (LocalState), so
checkpoints hold the same keys whatever the sharding, and a sharded run resumes unsharded and
the other way round.

Weight decay (Megatron-LM's and torchtitan's rule, ``takes_weight_decay``): none on norms and
biases. A flat buffer mixes both, so torch's AdamW runs with ``weight_decay=0`` and the decay is
applied here, before its step, as torch's AdamW applies it (``param *= 1 - lr * weight_decay``),
in one foreach multiply over the decayed spans of the buffer (adjacent ones merged), worked out
once: no Python loop over the parameters in a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from hethub.comm import Communicator, Group, Pending
from hethub.runtime.flat_layout import FlatLayout
from hethub.runtime.precision import MasterWeights
from hethub.runtime.torch_support import foreach_copy_, foreach_mul_, fused_optimizer_devices

MOMENTS = ("exp_avg", "exp_avg_sq")


class LocalState(NamedTuple):
    """One parameter's optimizer view on this rank: its TP shard, whole."""

    value: torch.Tensor
    """The fp32 (master) weight."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    """AdamW's step counter (a 0-d tensor)."""


def adamw(params: list[torch.Tensor], lr: float) -> torch.optim.AdamW:
    """AdamW over ``params`` (of one device), without weight decay (``WeightDecay`` applies it),
    fused where torch has a fused kernel for their device (CUDA, the CPU since torch 2.4, ...),
    else foreach: a few kernels over all of them either way, never a Python loop over the
    tensors."""
    fused = params[0].device.type in fused_optimizer_devices()
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=fused, foreach=not fused)


def takes_weight_decay(name: str, shape: Sequence[int]) -> bool:
    """Whether parameter ``name`` (full-model name) of ``shape`` decays: not a bias, nor a
    vector (the norms' weights), Megatron-LM's and torchtitan's rule. TP splits a tensor into
    shards of as many dimensions, so a shard's shape answers as the full one's."""
    return not name.endswith(".bias") and len(shape) > 1


def decayed_spans(layout: FlatLayout) -> list[tuple[int, int]]:
    """The (start, stop) spans of the flat buffers whose parameters decay, in buffer order,
    adjacent ones merged."""
    spans = sorted(
        layout.spans[name]
        for name, shape in layout.shapes.items()
        if takes_weight_decay(name, shape)
    )
    merged: list[tuple[int, int]] = []
    for start, stop in spans:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged


class WeightDecay:
    """Decoupled weight decay on the views of what an AdamW steps that decay."""

    def __init__(self, decayed: list[torch.Tensor], weight_decay: float) -> None:
        self.decayed, self.weight_decay = decayed, weight_decay

    def apply(self, lr: float) -> None:
        """Before AdamW's step at rate ``lr``: what torch's AdamW does first, one multiply."""
        if self.weight_decay and self.decayed:
            with torch.no_grad():
                foreach_mul_(self.decayed, 1.0 - lr * self.weight_decay)


def _set_lr(adamw: torch.optim.AdamW, lr: float | None) -> float:
    """The rate of the next step: ``lr`` set in AdamW's groups, or theirs when None."""
    if lr is not None:
        for group in adamw.param_groups:
            group["lr"] = lr
    return adamw.param_groups[0]["lr"]


def _moments_bytes(adamw: torch.optim.AdamW) -> int:
    return sum(t.nbytes for s in adamw.state.values() for t in s.values() if t.dim() > 0)


class PlainAdamW:
    """AdamW over every trained parameter of the rank, whole: its flat fp32 weights."""

    def __init__(self, weights: MasterWeights, lr: float, weight_decay: float) -> None:
        self.weights = weights
        self.flat = weights.fp32_flat
        self.flat.grad = weights.main_grads
        self.adamw = adamw([self.flat], lr)
        self.decay = WeightDecay(
            [self.flat[start:stop] for start, stop in decayed_spans(weights.layout)], weight_decay
        )

    @property
    def stepped_grads(self) -> list[torch.Tensor]:
        """The gradients the step reads (a clipping scales them): the main gradients, flat."""
        return [self.flat.grad]

    def step(self, lr: float | None = None) -> None:
        """Step on the synced gradients at rate ``lr`` (None: the last one); the stage then
        computes with the new weights."""
        self.decay.apply(_set_lr(self.adamw, lr))
        self.adamw.step()
        self.weights.copy_to_model()

    def gradients(self) -> dict[str, torch.Tensor]:
        """Between the sync and the step: every parameter's summed gradient by full-model name."""
        return {name: self.weights.grad(name) for name, _ in self.weights.named}

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps: the Adam moments, and in bf16 the fp32
        master weights (which exist for the optimizer alone)."""
        return _moments_bytes(self.adamw) + self.weights.master_bytes()

    def local_state(self) -> dict[str, LocalState]:
        """Every parameter's state by full-model name (zeros, step 0 before the first step: what
        AdamW would make)."""
        state = self.adamw.state.get(self.flat) or {}
        flats = [state[m] if state else torch.zeros_like(self.flat) for m in MOMENTS]
        # torch.zeros(()) has AdamW's own dtype for a step counter (float32).
        step = state["step"].clone() if state else torch.zeros(())
        view = self.weights.layout.view
        return {
            name: LocalState(view(self.flat, name).detach(), *(view(f, name) for f in flats), step)
            for name, _ in self.weights.named
        }

    def load_local_state(self, states: dict[str, LocalState]) -> None:
        """Install ``states`` (every parameter's, by full-model name)."""
        view = self.weights.layout.view
        moments = {m: torch.zeros_like(self.flat) for m in MOMENTS}
        with torch.no_grad():
            for name, _ in self.weights.named:
                view(self.flat, name).copy_(states[name].value)
                for m in MOMENTS:
                    view(moments[m], name).copy_(getattr(states[name], m))
        step = states[self.weights.named[0][0]].step
        # The optimizer's own loader puts the step counter where its kind keeps it (fused: on
        # the parameters' device).
        full = self.adamw.state_dict()
        full["state"] = {0: {"step": step, **moments}}
        self.adamw.load_state_dict(full)
        self.weights.copy_to_model()


class ShardedAdamW:
    """AdamW on this rank's shard of every gradient bucket, among its ``peers`` (see the
    module's docstring)."""

    def __init__(
        self,
        weights: MasterWeights,
        peers: Group,
        lr: float,
        weight_decay: float,
        comm: Communicator,
        *,
        overlap_gather: bool = False,
    ) -> None:
        """``weights``: laid out for ``peers.size`` shards; ``peers``: the data-parallel peers'
        group (RankGroups.data); ``comm`` runs and counts the all-gathers among them;
        ``overlap_gather``: the step leaves them under way (``wait_gather``)."""
        self.weights, self.peers, self.comm = weights, peers, comm
        self.overlap_gather = overlap_gather
        self._gathering: dict[int, Pending] = {}  # bucket -> its weights' all-gather, started
        self.shards, self.index = peers.size, peers.ranks.index(comm.rank)
        layout = weights.layout
        if layout.shards != self.shards:
            raise ValueError(
                f"weights laid out for {layout.shards} shards, sharded over {self.shards} peers"
            )
        if layout.unbucketed:  # every parameter has d > 1 holders, so every one is in a bucket
            raise ValueError(f"parameters outside the gradient buckets: {list(layout.unbucketed)}")
        self.weight_shards: list[torch.Tensor] = []
        """This rank's shard of each bucket of the stage's weights (compute dtype; views of its
        buffer), which the all-gather sends."""
        self.slices: list[torch.Tensor] = []
        """What AdamW steps, one per bucket: fp32, the shard of the weights itself; bf16, an
        fp32 master copy of it."""
        for b in range(len(layout.buckets)):
            start, stop = layout.shard(b, self.index)
            shard = weights.flat[start:stop]
            self.weight_shards.append(shard)
            piece = weights.masters[start:stop].clone() if self.keeps_masters else shard
            piece.grad = weights.main_grads[start:stop]
            self.slices.append(piece)
        weights.release_masters()  # bf16: the fp32 masters now live in the slices alone
        self.adamw = adamw(self.slices, lr)
        self.decay = WeightDecay(self._decayed_views(), weight_decay)

    @property
    def keeps_masters(self) -> bool:
        """bf16: the slices are master copies (fp32: the weights themselves)."""
        return self.weights.precision.master_weights

    def grad_shard(self, bucket: int) -> torch.Tensor:
        """Where the gradient sync leaves this rank's shard of ``bucket``'s sum (a view of the
        main gradients)."""
        return self.slices[bucket].grad

    @property
    def stepped_grads(self) -> list[torch.Tensor]:
        """The gradients the step reads (a clipping scales them): this rank's shard of each
        bucket's."""
        return [piece.grad for piece in self.slices]

    def _decayed_views(self) -> list[torch.Tensor]:
        """The parts of this rank's shards whose parameters decay (views of the slices)."""
        layout, views = self.weights.layout, []
        shards = [layout.shard(b, self.index) for b in range(len(layout.buckets))]
        for start, stop in decayed_spans(layout):
            for b, (low, high) in enumerate(shards):
                if start < high and low < stop:
                    views.append(self.slices[b][max(start, low) - low : min(stop, high) - low])
        return views

    def step(self, lr: float | None = None) -> None:
        """Step the shards at rate ``lr`` (None: the last one), all-gather them among the peers
        into the stage's weights (with an overlapped gather: start the all-gathers, bucket by
        bucket)."""
        self.finish_gathers()
        self.decay.apply(_set_lr(self.adamw, lr))
        self.adamw.step()
        with torch.no_grad():
            if self.keeps_masters:
                foreach_copy_(self.weight_shards, self.slices)
            layout = self.weights.layout
            for b, shard in enumerate(self.weight_shards):
                # Gathered in the dtype the stage computes in (bf16: half the bytes of the fp32
                # shard), in place: the shard is its own part of the bucket.
                whole = layout.bucket(self.weights.flat, b, padded=True)
                if self.overlap_gather:
                    self._gathering[b] = self.comm.start_all_gather_into(whole, shard, self.peers)
                else:
                    self.comm.all_gather_into(whole, shard, self.peers)

    @property
    def pending_gathers(self) -> tuple[int, ...]:
        """The buckets whose weights' all-gather is under way, not yet waited for."""
        return tuple(self._gathering)

    def wait_gather(self, bucket: int) -> None:
        """Bucket ``bucket``'s weights are gathered once this returns (at once where they are)."""
        started = self._gathering.pop(bucket, None)
        if started is not None:
            started.wait()

    def finish_gathers(self) -> None:
        """Every bucket's weights are gathered once this returns."""
        for bucket in list(self._gathering):
            self.wait_gather(bucket)

    def gradients(self) -> dict[str, torch.Tensor]:
        """Collective among the peers, between the sync and the step: every parameter's summed
        gradient by full-model name, whole (gathered from the shards)."""
        self.finish_gathers()
        out = {}
        for b, piece in enumerate(self.slices):
            out.update(self._gather(piece.grad, b))
        return out

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps: its shards' moments, and in bf16 their
        fp32 masters."""
        masters = sum(s.nbytes for s in self.slices) if self.keeps_masters else 0
        return _moments_bytes(self.adamw) + masters

    def local_state(self) -> dict[str, LocalState]:
        """Collective among the peers: every parameter's whole state by full-model name."""
        self.finish_gathers()
        out = {}
        for b, piece in enumerate(self.slices):
            state = self.adamw.state.get(piece) or {}
            gathered = [self._gather(piece.detach(), b)]
            for m in MOMENTS:
                gathered.append(self._gather(state[m] if state else torch.zeros_like(piece), b))
            step = state["step"].clone() if state else torch.zeros(())
            for name in gathered[0]:
                out[name] = LocalState(*(g[name] for g in gathered), step)
        return out

    def load_local_state(self, states: dict[str, LocalState]) -> None:
        """Install ``states`` (every parameter's, by full-model name): this rank's shards."""
        self.finish_gathers()  # a gather still under way would overwrite the weights installed
        state = {}
        with torch.no_grad():
            for b, span in enumerate(self.weights.layout.buckets):
                for name in span.names:
                    self.weights.write(name, states[name].value)
                self.slices[b].copy_(self._shard_of(states, "value", b))
                state[b] = {
                    "step": states[span.names[0]].step,
                    **{m: self._shard_of(states, m, b) for m in MOMENTS},
                }
        full = self.adamw.state_dict()
        full["state"] = state
        self.adamw.load_state_dict(full)

    def _shard_of(self, states: dict[str, LocalState], field: str, bucket: int) -> torch.Tensor:
        """This rank's shard of bucket ``bucket`` of the ``field`` of ``states``: fp32, its
        padding zero."""
        layout = self.weights.layout
        span = layout.buckets[bucket]
        flat = torch.zeros(span.stop - span.start, device=self.slices[bucket].device)
        for name in span.names:
            layout.view(flat, name, offset=span.start).copy_(getattr(states[name], field))
        start, stop = layout.shard(bucket, self.index)
        return flat[start - span.start : stop - span.start].clone()

    def _gather(self, piece: torch.Tensor, bucket: int) -> dict[str, torch.Tensor]:
        """The bucket's parameters by name, whole, from every peer's ``piece`` of it."""
        whole = self.comm.all_gather(piece, self.peers)
        layout, span = self.weights.layout, self.weights.layout.buckets[bucket]
        return {name: layout.view(whole, name, offset=span.start) for name in span.names}
