"""The optimizer of one rank: AdamW over its trained parameters, whole or sharded.

Sharded (a plan's ``shard_optimizer``; Megatron's distributed optimizer, ZeRO-1): the d ranks
holding exactly the same parameter shards (Topology.data_parallel_peers: the same stage and TP
rank of every replica of identical layouts) each keep 1/d of the optimizer state. Each gradient
bucket (runtime.grad_sync) is one flat buffer of the rank's local gradients; rank i of the d
owns its i-th slice (the buffer padded to a multiple of d): the fp32 master weights of the slice
and their two Adam moments. AdamW is elementwise, so stepping slices of a flat buffer is stepping
the parameters. After the step the d ranks all-gather the updated slices, in the dtype the stage
computes in, and write them into its weights. In bf16 the full fp32 masters are then dropped
(their grads stay: they are the fp32 main gradients), so a parameter costs 2 (bf16 weight) +
4 (main grad) + 12 / d bytes; in fp32, 4 (weight) + 4 (grad) + 12 / d (master slice and
moments).

Both kinds read and write their state as full local tensors by full-model name (LocalState), so
checkpoints hold the same keys whatever the sharding, and a sharded run resumes unsharded and
the other way round.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hethub.comm import Communicator, Group
from hethub.runtime.precision import MasterWeights

MOMENTS = ("exp_avg", "exp_avg_sq")


class LocalState(NamedTuple):
    """One parameter's optimizer view on this rank: its TP shard, whole."""

    value: torch.Tensor
    """The fp32 (master) weight."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    """AdamW's step counter (a 0-d tensor)."""


class PlainAdamW:
    """AdamW over every trained parameter of the rank, whole (MasterWeights' parameters)."""

    def __init__(self, weights: MasterWeights, lr: float, weight_decay: float) -> None:
        self.weights = weights
        self.adamw = torch.optim.AdamW(weights.parameters(), lr=lr, weight_decay=weight_decay)

    def step(self) -> None:
        """Step on the synced gradients; the stage then computes with the new weights."""
        self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        self.weights.copy_to_model()

    def gradients(self) -> dict[str, torch.Tensor]:
        """Between the sync and the step: every parameter's summed gradient by full-model name."""
        return {name: param.grad for name, param in self.weights.named}

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps: the Adam moments, and in bf16 the fp32
        master weights (which exist for the optimizer alone)."""
        moments = sum(
            t.nbytes for s in self.adamw.state.values() for t in s.values() if t.dim() > 0
        )
        return moments + self.weights.master_bytes()

    def local_state(self) -> dict[str, LocalState]:
        """Every parameter's state by full-model name (zeros, step 0 before the first step: what
        AdamW would make)."""
        out = {}
        for name, param in self.weights.named:
            state = self.adamw.state.get(param) or {}
            moments = [state[m] if state else torch.zeros_like(param) for m in MOMENTS]
            # torch.zeros(()) has AdamW's own dtype for a CPU step counter (the default float).
            step = state["step"].clone() if state else torch.zeros(())
            out[name] = LocalState(param.detach(), *moments, step)
        return out

    def load_local_state(self, states: dict[str, LocalState]) -> None:
        """Install ``states`` (every parameter's, by full-model name)."""
        index = {id(p): i for i, p in enumerate(self.weights.parameters())}
        state = {}
        with torch.no_grad():
            for name, param in self.weights.named:
                loaded = states[name]
                param.copy_(loaded.value)
                state[index[id(param)]] = {
                    "step": loaded.step,
                    "exp_avg": loaded.exp_avg,
                    "exp_avg_sq": loaded.exp_avg_sq,
                }
        # The optimizer's own loader puts the moments on the parameters' devices and dtypes and
        # keeps the step counter as saved (a CPU tensor, capturable and fused being off).
        full = self.adamw.state_dict()
        full["state"] = state
        self.adamw.load_state_dict(full)
        self.weights.copy_to_model()


class ShardedAdamW:
    """AdamW on this rank's slice of every gradient bucket, among its ``peers`` (see the
    module's docstring). The gradient sync hands it each bucket's gradient slice (set_grad)."""

    def __init__(
        self,
        weights: MasterWeights,
        buckets: list[list[tuple[str, nn.Parameter]]],
        peers: Group,
        lr: float,
        weight_decay: float,
        comm: Communicator,
    ) -> None:
        """``peers``: the data-parallel peers' group (RankGroups.data); ``comm`` runs and counts
        the all-gathers among them."""
        self.weights, self.buckets, self.peers, self.comm = weights, buckets, peers, comm
        self.shards, self.index = peers.size, peers.ranks.index(comm.rank)
        bucketed = {name for params in buckets for name, _ in params}
        missing = [name for name, _ in weights.named if name not in bucketed]
        if missing:  # every parameter has d > 1 holders, so every one is in a bucket
            raise ValueError(f"parameters outside the gradient buckets: {missing}")
        self.slices = []
        with torch.no_grad():
            for params in buckets:
                flat = self.pad(torch.cat([p.detach().reshape(-1) for _, p in params]))
                self.slices.append(nn.Parameter(self.my_slice(flat).clone()))
        weights.release_masters()  # bf16: the fp32 masters now live in the slices alone
        self.adamw = torch.optim.AdamW(self.slices, lr=lr, weight_decay=weight_decay)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` padded with zeros to a multiple of the shards."""
        extra = -flat.numel() % self.shards
        return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat

    def my_slice(self, padded: torch.Tensor) -> torch.Tensor:
        size = padded.numel() // self.shards
        return padded[self.index * size : (self.index + 1) * size]

    def set_grad(self, bucket: int, grad: torch.Tensor) -> None:
        """The summed gradient of this rank's slice of ``bucket``."""
        self.slices[bucket].grad = grad

    def step(self) -> None:
        """Step the slices, all-gather them among the peers and write the weights."""
        self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        for _, param in self.weights.named:
            param.grad = None  # the main gradients, summed into the slices' already
        with torch.no_grad():
            for b, params in enumerate(self.buckets):
                # Gathered in the dtype the stage computes in (bf16: half the bytes of the fp32
                # slice); the cast is elementwise, so it is the same as casting after the gather.
                piece = self.slices[b].detach().to(self.weights.compute_dtype)
                for (name, _), value in zip(params, self._gather(piece, b)):
                    self.weights.write(name, value)

    def gradients(self) -> dict[str, torch.Tensor]:
        """Collective among the peers, between the sync and the step: every parameter's summed
        gradient by full-model name, whole (gathered from the slices)."""
        out = {}
        for b, params in enumerate(self.buckets):
            for (name, _), grad in zip(params, self._gather(self.slices[b].grad, b)):
                out[name] = grad
        return out

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps: its slices' fp32 masters and moments."""
        moments = sum(
            t.nbytes for s in self.adamw.state.values() for t in s.values() if t.dim() > 0
        )
        return moments + sum(s.nbytes for s in self.slices)

    def local_state(self) -> dict[str, LocalState]:
        """Collective among the peers: every parameter's whole state by full-model name."""
        out = {}
        for b, params in enumerate(self.buckets):
            piece = self.slices[b]
            state = self.adamw.state.get(piece) or {}
            gathered = [self._gather(piece.detach(), b)]
            for m in MOMENTS:
                gathered.append(self._gather(state[m] if state else torch.zeros_like(piece), b))
            step = state["step"].clone() if state else torch.zeros(())
            for k, (name, _) in enumerate(params):
                out[name] = LocalState(*(g[k] for g in gathered), step)
        return out

    def load_local_state(self, states: dict[str, LocalState]) -> None:
        """Install ``states`` (every parameter's, by full-model name): this rank's slices."""
        state = {}
        with torch.no_grad():
            for b, params in enumerate(self.buckets):

                def part(field: str, params=params) -> torch.Tensor:
                    flat = torch.cat([getattr(states[n], field).reshape(-1) for n, _ in params])
                    return self.my_slice(self.pad(flat.float())).clone()

                self.slices[b].copy_(part("value"))
                state[b] = {
                    "step": states[params[0][0]].step,
                    "exp_avg": part("exp_avg"),
                    "exp_avg_sq": part("exp_avg_sq"),
                }
                for name, _ in params:
                    self.weights.write(name, states[name].value)
        full = self.adamw.state_dict()
        full["state"] = state
        self.adamw.load_state_dict(full)

    def _gather(self, piece: torch.Tensor, bucket: int) -> list[torch.Tensor]:
        """The bucket's full flat tensor from every peer's ``piece`` of it, split back into its
        parameters' shapes."""
        whole = self.comm.all_gather(piece, self.peers)
        params = self.buckets[bucket]
        sizes = [p.numel() for _, p in params]
        pieces = whole[: sum(sizes)].split(sizes)
        return [t.view(p.shape) for t, (_, p) in zip(pieces, params, strict=True)]
