"""HuggingFace safetensors in and out: a HF folder's weights as a run's starting weights, and a
run's checkpoint as a HF folder.

In (``load_hf_weights``, collective): every rank reads only its stage's TP slices, with
safetensors' ``get_slice`` on the files holding them (model.safetensors, or the shards that
model.safetensors.index.json names), builds each hethub parameter's shard from them
(spec.hf_names: q/k/v fused in hethub's blocks, GPT-2's Conv1D transposed and its c_attn split)
in fp32, and installs it through the optimizer's load_local_state with zero moments and step 0,
as a checkpoint's load does. A parameter is read when the optimizer asks for it and dropped once
copied in, and a file is opened for one tensor at a time (its mapping, whose pages count in the
process's memory, closed after it): the load holds this rank's weights once, in the optimizer,
and one tensor besides. A config and weights that disagree (a tensor missing, of another shape,
or one the model has no place for) is one HethubError naming the tensor, on every rank.

Out (``export_checkpoint``, one process): the run's DCP checkpoint read a shard's worth of
parameters at a time (whole tensors, whatever plan wrote them), converted to HF names and
layout, and written as safetensors shards of at most ``max_shard_bytes`` with their index.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hethub.errors import HethubError
from hethub.runtime.checkpoint import agree
from hethub.runtime.optimizer import LocalState
from hethub.spec.hf_names import (
    HfPart,
    HfSource,
    hf_sources,
    hf_tensors,
    is_ignored_buffer,
    part_slice,
    tied_head_name,
    unprefixed,
)
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import parameter_table

if TYPE_CHECKING:  # the engine does not need this module; annotations only
    from hethub.runtime.engine import Engine

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""transformers' default shard cap (5 GB)."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The dtypes an export writes, by their flag's name."""
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


class HfWeights:
    """The safetensors files of a HF folder, as the tensors a model ``spec`` needs: which file
    holds each (by the name the model gives it; a checkpoint of the base model alone may leave
    the base prefix out), read slice by slice."""

    def __init__(self, folder: Path, spec: ModelSpec) -> None:
        """HethubError when the folder holds no weights, or not the ones ``spec`` has."""
        self.folder, self.spec = Path(folder), spec
        stored = _stored_names(self.folder)  # name on file -> file
        self.files: dict[str, Path] = {}  # the model's HF name -> file
        self.stored_name: dict[str, str] = {}  # the model's HF name -> the name on file
        for name in hf_tensors(spec):
            on_file = name if name in stored else unprefixed(spec, name)
            if on_file not in stored:
                raise HethubError(
                    f"{self.folder}: the weights have no {name}, which the model's config needs"
                )
            self.files[name], self.stored_name[name] = stored[on_file], on_file
        used = set(self.stored_name.values())
        tied = tied_head_name(spec)
        for on_file in stored:
            if on_file in used or is_ignored_buffer(on_file) or on_file == tied:
                continue
            raise HethubError(
                f"{self.folder}: the weights hold {on_file}, which the model's config has no "
                "place for: the config and the weights disagree"
            )

    def read(self, part: HfPart, tp_dim: int | None, rank: int, tp: int) -> torch.Tensor:
        """TP rank ``rank`` of ``tp``'s slice of ``part`` in hethub's layout, fp32: only those
        bytes of the file are read."""
        want = part_slice(part, tp_dim, rank, tp)
        on_file = self.stored_name[part.name]
        with safe_open(self.files[part.name], framework="pt") as file:
            piece = file.get_slice(on_file)
            shape = tuple(piece.get_shape())
            if shape != part.shape:
                raise HethubError(
                    f"{self.folder}: {on_file} has shape {list(shape)} in the weights, the "
                    f"model's config needs {list(part.shape)}"
                )
            rows = slice(want.row_start, want.row_stop)
            cols = slice(*want.cols) if want.cols is not None else slice(None)
            if len(shape) == 1:
                tensor = piece[rows]
            elif part.transposed:  # [in, out] on file: the rows are its columns
                tensor = piece[cols, rows].t()
            else:
                tensor = piece[rows, cols]
        return tensor.to(torch.float32).reshape(want.view)

    def parameter(self, name: str, rank: int = 0, tp: int = 1) -> torch.Tensor:
        """Hethub parameter ``name``'s TP shard ``rank`` of ``tp`` (whole: the defaults), fp32."""
        source = hf_sources(self.spec)[name]
        tp_dim = parameter_table(self.spec)[name].tp_dim
        pieces = [self.read(part, tp_dim, rank, tp) for part in source.parts]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=source.dim)


def _stored_names(folder: Path) -> dict[str, Path]:
    """Every tensor of the folder's safetensors by its name, with the file holding it: from the
    index where there is one (no file opened), else from model.safetensors' header."""
    if not folder.is_dir():
        raise HethubError(f"{folder}: no such folder (give a HuggingFace model folder)")
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {str(name): folder / str(file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise HethubError(f"{index}: not a safetensors index ({error})") from None
    single = folder / SINGLE
    if not single.is_file():
        raise HethubError(
            f"{folder}: no {SINGLE} nor {INDEX} in it (hethub reads HuggingFace safetensors)"
        )
    try:
        with safe_open(single, framework="pt") as file:
            return dict.fromkeys(file.keys(), single)
    except (SafetensorError, OSError) as error:
        raise HethubError(f"{single}: not a safetensors file ({error})") from None


class _ReadOnDemand(Mapping):
    """Every parameter's LocalState of a fresh start (the weight from the HF files, zero
    moments, step 0), each read when asked for and the last one kept: load_local_state reads a
    parameter's fields one after another, so the rank's weights are never held twice."""

    def __init__(self, names: list[str], read: Callable[[str], torch.Tensor]) -> None:
        self.names, self.read = names, read
        self._last: tuple[str, LocalState] | None = None

    def __getitem__(self, name: str) -> LocalState:
        if self._last is None or self._last[0] != name:
            value = self.read(name)
            zero = torch.zeros((), dtype=value.dtype).expand(value.shape)  # no memory
            self._last = (name, LocalState(value, zero, zero, torch.zeros(())))
        return self._last[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_hf_weights(engine: Engine, folder: Path) -> None:
    """Collective: start ``engine`` from the weights of the HF folder ``folder`` (its model
    must be the engine's), this rank reading only its stage's TP slices; AdamW's moments zero,
    step 0. HethubError on every rank, naming the tensor, where the weights and the model
    disagree."""
    weights, problem = None, None
    try:
        weights = HfWeights(Path(folder), engine.spec)
    except HethubError as error:
        problem = str(error)
    agree(problem)
    rank, tp = engine.me.tp_rank, engine.me.tp
    names = [name for name, _ in engine.weights.named]
    try:
        engine.finish_param_gather()
        engine.optimizer.load_local_state(
            _ReadOnDemand(names, lambda name: weights.parameter(name, rank, tp))
        )
    except HethubError as error:
        problem = str(error)
    agree(problem)


def hf_tensors_of(spec: ModelSpec, name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """The HF tensors (by name, in the file's layout) of hethub parameter ``name``'s full
    tensor ``full``: spec.hf_names' mapping backwards."""
    source: HfSource = hf_sources(spec)[name]
    pieces = full.split([part.view[source.dim] for part in source.parts], dim=source.dim)
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for part, piece in zip(source.parts, pieces, strict=True):
        linear = piece.reshape(part.rows, *part.linear_shape[1:])  # [rows, *in]
        rows.setdefault(part.name, []).append((part.row_start, linear))
    out = {}
    for part in source.parts:
        if part.name in out:
            continue
        linear = torch.cat([t for _, t in sorted(rows[part.name], key=lambda r: r[0])])
        out[part.name] = linear.t() if part.transposed else linear
    return out


def check_checkpoint_model(checkpoint: Path, spec: ModelSpec) -> None:
    """HethubError, naming the first, where the DCP checkpoint at ``checkpoint`` lacks a weight
    of ``spec`` of its full shape (read from its metadata alone)."""
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    for name, param in parameter_table(spec).items():
        found = saved.get(f"model/{name}")
        if found is None or list(getattr(found, "size", [])) != list(param.shape):
            raise HethubError(
                f"checkpoint {checkpoint} has no model/{name} of shape {list(param.shape)}: it "
                f"was not written for the model {spec.name}"
            )


@dataclass(frozen=True, slots=True)
class ExportedShard:
    """One safetensors file of an export: its name and the hethub parameters it holds."""

    file: str
    parameters: tuple[str, ...]


def plan_shards(spec: ModelSpec, dtype: torch.dtype, max_shard_bytes: int) -> list[ExportedShard]:
    """The export's files: the parameters in the model's order, each with its HF tensors in one
    file, a file closed before it would pass ``max_shard_bytes`` (a parameter larger than that
    alone in its own). One file: model.safetensors; else transformers' shard names."""
    size = torch.empty((), dtype=dtype).element_size()
    groups: list[list[str]] = [[]]
    filled = 0
    for name, param in parameter_table(spec).items():
        nbytes = math.prod(param.shape) * size
        if groups[-1] and filled + nbytes > max_shard_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += nbytes
    if len(groups) == 1:
        return [ExportedShard(SINGLE, tuple(groups[0]))]
    n = len(groups)
    return [
        ExportedShard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(group))
        for i, group in enumerate(groups)
    ]


def export_checkpoint(
    checkpoint: Path,
    spec: ModelSpec,
    out: Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write the weights of the DCP checkpoint at ``checkpoint`` (of model ``spec``, saved
    under any plan) into ``out`` as HF safetensors in ``dtype``: one shard's parameters read at
    a time, so memory holds one shard, not the model. The files written (the index last, where
    there are several). HethubError where the checkpoint lacks a parameter of the model."""
    out = Path(out)
    reader = dcp.FileSystemReader(checkpoint)
    check_checkpoint_model(checkpoint, spec)
    table = parameter_table(spec)
    shards = plan_shards(spec, dtype, max_shard_bytes)
    written, weight_map, total = [], {}, 0
    for shard in shards:
        fulls = {f"model/{n}": torch.empty(table[n].shape) for n in shard.parameters}
        with warnings.catch_warnings():  # DCP warns that it reads in one process: it is meant to
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(fulls, storage_reader=reader, no_dist=True)
        tensors = {}
        for name in shard.parameters:
            for hf_name, tensor in hf_tensors_of(spec, name, fulls.pop(f"model/{name}")).items():
                tensors[hf_name] = tensor.to(dtype).contiguous()
        save_file(tensors, out / shard.file, metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, shard.file))
        written.append(out / shard.file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / INDEX)
    return written
