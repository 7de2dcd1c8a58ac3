"""What one training micro-batch of the runtime's model asks of the device: the aten operations
(views aside, each one a kernel launch or more on an accelerator) of one forward and backward of
a one-stage model at TP 1, and the bytes its forward keeps for the backward (distinct storages,
the parameters' aside). Counted on the CPU: the operations and the saved bytes are the same on
any device, only their speed differs.

Usage: python benchmarks/layer_kernels.py [--model local-llama] [--micro-batch 1]
"""

from __future__ import annotations

import argparse
from typing import Self

import torch

from hethub.profiler.op_counts import OpCounter
from hethub.runtime.model import Stage
from hethub.runtime.precision import MasterWeights
from hethub.spec import load_model


class SavedBytes:
    """The bytes of the distinct storages a forward keeps for its backward, ``ignored``'s (the
    parameters') aside."""

    def __init__(self, ignored: list[torch.Tensor]) -> None:
        self.ignored = {t.untyped_storage().data_ptr() for t in ignored}
        self.kept: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.ignored:
            self.kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> Self:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.kept.values())


def one_step(model: str, precision: str, micro_batch: int) -> tuple[OpCounter, int, int]:
    """Forward, loss and backward of the whole ``model`` as one stage at TP 1: its operations
    (forward and backward together), the bytes saved for backward and the forward's op count."""
    spec = load_model(model)
    stage = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=0)
    MasterWeights(stage, precision)  # bf16: the stage's weights become bf16
    tokens = torch.randint(0, spec.vocab, (micro_batch, spec.seq_len + 1))
    with OpCounter() as ops, SavedBytes(list(stage.parameters())) as saved:
        loss = stage.loss(stage(tokens[:, :-1]), tokens[:, 1:])
    forward = ops.total
    with ops:
        loss.backward()
    return ops, saved.total, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="local-llama")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--top", type=int, default=12, help="most frequent operations shown")
    args = parser.parse_args()
    for precision in ("fp32", "bf16"):
        ops, saved, forward = one_step(args.model, precision, args.micro_batch)
        print(
            f"{args.model} {precision} mb={args.micro_batch}: {ops.total} operations "
            f"({forward} forward, {ops.total - forward} backward), "
            f"{saved / 2**20:.2f} MiB saved for backward"
        )
        for name, count in ops.ops.most_common(args.top):
            print(f"  {count:5d} {name}")


if __name__ == "__main__":
    main()
