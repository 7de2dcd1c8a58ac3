"""Checkpoints of a training job (torch.distributed.checkpoint), resumable under any plan.

Layout independence: a checkpoint holds tensors of their FULL shape keyed by full-model parameter
names (hethub.spec.parameters' names): ``model/<name>`` (the weight), ``optim/<name>/exp_avg``,
``optim/<name>/exp_avg_sq`` and ``optim/<name>/step`` (AdamW's state). So any plan resumes any
other plan's checkpoint: another pipeline split, another TP degree, other replicas.

Sharded saves: every rank writes only what it holds, never a gathered whole. A tensor TP splits
is offered as a DTensor over the stage's TP group (Shard along the parameter's tp_dim), so DCP
writes each TP rank's slice as a chunk of the full tensor with its offsets; a tensor held whole
(a norm, a row-parallel bias, a step counter) by each TP rank of the stage, one of whose copies
DCP's planner keeps (dedup_save_plans, keyed by name and offset). Each parameter is written by
one stage of its holders (``_writers``: the holders in turn, so the writes spread over the
replicas): replicas of unlike layouts (TP 2 here, TP 1 there) would otherwise offer overlapping
chunks of one tensor, which DCP refuses. On load every rank asks for exactly its own TP slice
(a DTensor of the new plan's layout) and DCP reads it out of whichever chunks overlap it:
checkpoints of any TP degree, and those of the layout before (full tensors, one chunk each),
load alike. The weights are the fp32 master weights in either precision (runtime.precision), so
a checkpoint resumes under another precision too. A sharded optimizer's local_state still
gathers its peers' flat slices into this rank's TP shard (a collective among the data-parallel
peers, of one TP shard's size) before the save.

Checkpoints written before the fused GEMMs hold each layer's q, k and v (gate and up)
separately: ``model/layers.{i}.q.weight``, its moments and step, and so on. They still load:
where a checkpoint has no fused key but the parts (spec.parameters.fused_parts, the one table of
renames), the parts' full weights and both moments are read and fused (runtime.model.fuse) into
the fused parameter's, and its step is the first part's (every parameter steps together). Such
checkpoints are old and small; saves always write the fused names.

Atomicity: a crash mid-save never leaves a checkpoint that loads. Every rank writes into
``step-000012.tmp-<token>``; once a barrier shows every rank has finished, rank 0 writes
``meta.json`` in it and renames the folder to ``step-000012`` (a rename on one filesystem is
atomic). A checkpoint is complete exactly when its folder has that name and holds meta.json:
latest_checkpoint looks at nothing else and load_checkpoint refuses anything else.
``checkpoints_dir`` must be one filesystem that every rank sees.

Damage after the publish (a truncated copy, a flipped bit on disk): meta.json lists every file
with its size and SHA-256 (checkpoint_folders.file_entry), read once every rank has written and
before the rename, so the list is published with the files: each rank hashes every world-th file
of rank 0's listing (DCP writes about one file a rank), so the save waits for one rank's share
of the reading, not the whole checkpoint's. A resume takes
the newest checkpoint that matches it (checkpoint_folders.latest_intact_checkpoint). Damage that
slips past (a checkpoint from before the manifest) fails the load in one HethubError on every
rank, never a traceback per rank.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hethub.errors import HethubError
from hethub.memo import memoized
from hethub.runtime.checkpoint_folders import (
    MANIFEST,
    META,
    checkpoint_files,
    file_entry,
    keep_latest,
    read_meta,
)
from hethub.runtime.model import fuse, shard
from hethub.runtime.optimizer import MOMENTS, LocalState
from hethub.spec.model import ModelSpec
from hethub.spec.parameters import FusedParts, fused_parts
from hethub.spec.topology import Topology, parameter_holders

if TYPE_CHECKING:  # the engine does not need this module; annotations only
    from hethub.runtime.engine import Engine


def save_checkpoint(
    engine: Engine, checkpoints_dir: Path, step: int, meta: dict, keep: int | None = None
) -> Path:
    """Collective (every rank, after an optimizer step): save the job's weights and AdamW state
    as ``checkpoints_dir/step-<step>``, replacing a checkpoint of the same step; its path. With
    ``keep``, only the latest ``keep`` complete checkpoints remain afterwards."""
    meta = {**meta, "step": step}
    json.dumps(meta)  # on every rank: a bad meta fails everywhere
    final = Path(checkpoints_dir) / f"step-{step:06d}"
    token = [uuid.uuid4().hex[:8] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)  # one temporary folder for the whole job
    tmp = final.with_name(f"{final.name}.tmp-{token[0]}")
    tmp.mkdir(parents=True, exist_ok=True)
    dcp.save(_state_to_save(engine), storage_writer=dcp.FileSystemWriter(tmp))
    dist.barrier()  # every rank's files are written (and synced) before the folder is published
    meta[MANIFEST] = _manifest(tmp)
    agree(_publish(tmp, final, meta) if dist.get_rank() == 0 else None)
    if keep is not None and dist.get_rank() == 0:
        keep_latest(checkpoints_dir, keep)
    return final


def load_checkpoint(engine: Engine, path: Path) -> dict:
    """Collective: load the weights and AdamW state of this rank's stage and TP shard from the
    checkpoint at ``path`` (written under any plan); its meta.json (the saved meta and "step",
    the manifest of its files aside).

    Raises HethubError on every rank, before anything is read, when the checkpoint is missing,
    unfinished or written for another model."""
    path = Path(path)
    meta, metadata, problem = _read_meta(path)
    buffers: dict[str, torch.Tensor] = {}
    if problem is None:
        buffers, problem = _buffers(engine, path, metadata)
    agree(problem)  # one rank's problem stops every rank here, not inside dcp.load
    try:
        dcp.load(buffers, storage_reader=dcp.FileSystemReader(path))
    except CheckpointException as error:  # raised on every rank when one rank's read failed
        raise HethubError(_unloadable(path, error)) from None
    _install(engine, buffers)
    return meta


def _state_to_save(engine: Engine) -> dict[str, torch.Tensor]:
    """This rank's part of the checkpoint under its keys: the weights and AdamW state of the
    parameters its stage writes (``_writers``), each TP-split tensor as this rank's slice of
    the full one (a sharded optimizer first gathers its TP shard among its peers)."""
    engine.finish_param_gather()
    states = engine.optimizer.local_state()
    writers = _writers(engine.topology, engine.spec)
    out: dict[str, torch.Tensor] = {}
    for name, _ in engine.weights.named:
        if writers[name] != engine.groups.leader:
            continue  # another stage holding it writes it
        state = states[name]
        for field in FIELDS:
            out[_key(name, field)] = _slice_of_full(engine, name, getattr(state, _FIELD[field]))
        out[_key(name, "step")] = state.step
    return out


_FIELD = {"model": "value", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""A checkpoint field's LocalState attribute."""


@memoized
def _writers(topology: Topology, spec: ModelSpec) -> dict[str, int]:
    """For every parameter: the leader of the stage that writes it, one of its holders
    (topology.parameter_holders) taken in turn along the parameter table, so that every
    replica writes its share. The same answer on every rank, from the topology alone."""
    holders = parameter_holders(topology, spec)
    return {name: holders[name][i % len(holders[name])] for i, name in enumerate(holders)}


def _tp_mesh(engine: Engine, device_type: str) -> DeviceMesh | None:
    """The stage's TP group as a one-dimensional DeviceMesh (None at TP 1): what a DTensor shard
    of a TP-split tensor lives on. Made from the group itself: no new process group."""
    if engine.groups.tp.handle is None:
        return None
    return DeviceMesh.from_group(engine.groups.tp.handle, device_type)


def _slice_of_full(engine: Engine, name: str, local: torch.Tensor) -> torch.Tensor:
    """``local``, this rank's TP shard of parameter ``name``'s tensor, as DCP is to see it: a
    DTensor slice of the full tensor where TP splits it, else itself (whole)."""
    layout = engine.parameter_table[name]
    mesh = _tp_mesh(engine, local.device.type) if layout.tp_dim is not None else None
    if mesh is None:
        return local
    full = torch.Size(layout.shape)
    return DTensor.from_local(
        local.contiguous(),
        mesh,
        [Shard(layout.tp_dim)],
        run_check=False,
        shape=full,
        stride=_contiguous_stride(full),
    )


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _unloadable(path: Path, error: CheckpointException) -> str:
    """One line for a load that failed inside DCP (whose message holds every rank's traceback):
    the first failed rank's error."""
    rank, (first, _) = min(error.failures.items(), key=lambda failure: failure[0])
    said = str(first).strip().splitlines()
    return (
        f"checkpoint {path} cannot be loaded (rank {rank}: {type(first).__name__}"
        f"{': ' + said[0] if said else ''}): it is damaged"
    )


def _manifest(tmp: Path) -> list[dict]:
    """Collective, once every rank's files are written: the manifest of the folder (rank 0's
    listing), each rank hashing every world-th file. HethubError on every rank when one could
    not read its share."""
    rank, world = dist.get_rank(), dist.get_world_size()
    listing: list = [None, None]  # the files, or the problem of listing them
    if rank == 0:
        try:
            listing[0] = checkpoint_files(tmp)
        except OSError as error:
            listing[1] = f"could not read checkpoint {tmp}: {error}"
    dist.broadcast_object_list(listing, src=0)
    names, problem = listing
    entries = []
    if problem is None:
        try:
            entries = [file_entry(tmp, name) for name in names[rank::world]]
        except OSError as error:
            problem = f"could not read checkpoint {tmp}: {error}"
    shares: list = [None] * world
    dist.all_gather_object(shares, (entries, problem))
    problem = next((p for _, p in shares if p), None)
    if problem is not None:  # every rank has every share: each raises the same
        raise HethubError(problem)
    return sorted((entry for share, _ in shares for entry in share), key=lambda e: e["path"])


def _publish(tmp: Path, final: Path, meta: dict) -> str | None:
    """Rank 0: write the written folder's meta.json, and give it its final name; a problem, or
    None."""
    try:
        text = json.dumps(meta, indent=1)
        with open(tmp / META, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        old = None
        if final.exists():
            # Two folders cannot swap atomically: the old one steps aside under a name that is no
            # checkpoint's first, so a crash in between loses that step but never loads a mix.
            old = final.with_name(tmp.name.replace(".tmp-", ".old-"))
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old)
    except OSError as error:
        return f"could not publish checkpoint {final}: {error}"
    return None


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a crash right after keeps it)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def agree(problem: str | None) -> None:
    """Every rank raises the first rank's problem (or none does): no rank goes on into a
    collective the others have left. Also a barrier."""
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise HethubError(first)


def _read_meta(path: Path) -> tuple[dict, Metadata | None, str | None]:
    """The checkpoint's meta.json and DCP metadata, or the problem that makes it unusable."""
    try:
        return read_meta(path), dcp.FileSystemReader(path).read_metadata(), None
    except HethubError as error:
        return {}, None, str(error)
    # Whatever is torn or unreadable: one message on every rank, not a crash on some of them.
    except Exception as error:  # noqa: BLE001
        return {}, None, f"checkpoint {path} cannot be read: {error}"


def _key(name: str, field: str) -> str:
    """The checkpoint key of parameter ``name``'s ``field``: "model" (the weight), a moment or
    "step"."""
    return f"model/{name}" if field == "model" else f"optim/{name}/{field}"


FIELDS = ("model", *MOMENTS)
"""A parameter's full tensors in a checkpoint, of its full shape (its step counter aside)."""


def _parts_before_fusion(engine: Engine, name: str) -> tuple[FusedParts, list[str]] | None:
    """Where parameter ``name`` is a fused one (``layers.3.qkv.weight``): how it is made of the
    parameters of the layers before the fused GEMMs, and their full-model names
    (``layers.3.q.weight``, ...). None for any other parameter."""
    outer, _, local = name.partition(".")
    layer, _, local = local.partition(".")
    parts = fused_parts(engine.spec).get(local) if outer == "layers" else None
    if parts is None:
        return None
    return parts, [f"layers.{layer}.{part}" for part in parts.names]


def _wanted(engine: Engine, name: str, saved: Metadata) -> dict[str, list[int]]:
    """The keys this rank loads for parameter ``name`` with the full shape of each: its own,
    or, where the checkpoint has them instead (written before the fused GEMMs), its parts' (the
    first part's step counter stands for the fused one's: every parameter steps together)."""
    shape = list(engine.parameter_table[name].shape)
    own = {**{_key(name, field): shape for field in FIELDS}, _key(name, "step"): []}
    before = _parts_before_fusion(engine, name)
    if before is None or _key(name, "model") in saved.state_dict_metadata:
        return own
    parts, names = before
    if not any(_key(part, "model") in saved.state_dict_metadata for part in names):
        return own  # neither: refused for the fused parameter's absence
    wanted = {_key(names[0], "step"): []}
    for part, part_shape in zip(names, parts.shapes, strict=True):
        wanted.update({_key(part, field): list(part_shape) for field in FIELDS})
    return wanted


def _nor_parts(engine: Engine, name: str) -> str:
    """For a fused parameter missing from a checkpoint: that its parts are missing too."""
    before = _parts_before_fusion(engine, name)
    if before is None:
        return ""
    *others, last = before[1]
    return f" (nor its parts before the fused GEMMs, {', '.join(others)} and {last})"


def _buffers(
    engine: Engine, path: Path, metadata: Metadata
) -> tuple[dict[str, torch.Tensor], str | None]:
    """Empty full-shape tensors for every key this rank loads, checked against the
    checkpoint's metadata; or the first mismatch, said for the user."""
    buffers = {}
    for name, param in engine.weights.named:
        for key, shape in _wanted(engine, name, metadata).items():
            saved = metadata.state_dict_metadata.get(key)
            what = key.removeprefix("model/")
            if not isinstance(saved, TensorStorageMetadata):
                return {}, (
                    f"checkpoint {path} has no {what}{_nor_parts(engine, what)}: it was written "
                    "for another model"
                )
            if list(saved.size) != shape:
                return {}, (
                    f"checkpoint {path} holds {what} of shape {list(saved.size)}, the model "
                    f"needs {shape}: it was written for another model"
                )
            if key.endswith("/step"):  # AdamW's step counter stays in the dtype it was saved in
                buffers[key] = torch.empty(shape, dtype=saved.properties.dtype)
            elif key.split("/")[1] == name:  # this rank's slice: DCP reads only what overlaps it
                layout = engine.parameter_table[name]
                local = torch.empty(layout.shard_shape(engine.me.tp), dtype=param.dtype)
                buffers[key] = _slice_of_full(engine, name, local)
            else:  # a part of a fused parameter, from before the fused GEMMs: old and small
                buffers[key] = torch.empty(shape, dtype=param.dtype)
    return buffers, None


def _install(engine: Engine, buffers: dict[str, torch.Tensor]) -> None:
    """Hand this rank's TP shard of the loaded tensors to its optimizer, which sets the weights
    too; a fused parameter loaded as its parts is fused and sliced first."""
    rank, tp = engine.me.tp_rank, engine.me.tp
    states = {}
    for name, _ in engine.weights.named:
        if _key(name, "model") in buffers:  # loaded as this rank's slices
            local = [_local(buffers[_key(name, field)]) for field in FIELDS]
            step = buffers[_key(name, "step")]
        else:  # written before the fused GEMMs: the parts' full tensors
            layout = engine.parameter_table[name]
            parts, names = _parts_before_fusion(engine, name)
            local = [
                shard(layout, fuse(parts, [buffers[_key(part, field)] for part in names]), rank, tp)
                for field in FIELDS
            ]
            step = buffers[_key(names[0], "step")]
        states[name] = LocalState(*local, step)
    engine.optimizer.load_local_state(states)


def _local(loaded: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a loaded tensor: a DTensor's local slice, or a tensor held whole."""
    return loaded.to_local() if isinstance(loaded, DTensor) else loaded
