"""Profiles on disk: measured per-layer costs and link speeds, one JSON file per key.

Pure Python (the predictor and the planner read profiles and import no torch). A layer profile is
keyed by everything its numbers depend on: the device kind, the layer's shape (and the vocabulary,
for the embedding and the head), the dtype, the threads per rank, how many ranks computed at once
on the machine, the TP degree and the micro-batch size. Lookups match the whole key exactly, so a
profile of another shape, thread count or concurrency is never used in its place.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hethub.errors import HethubError, SpecError
from hethub.files import write_atomic
from hethub.report.text import plural
from hethub.spec.cluster import ClusterSpec
from hethub.spec.fields import Fields
from hethub.spec.hashing import hashed_once
from hethub.spec.model import ARCHS, ModelSpec, arch_defaults
from hethub.spec.plan import Precision

FORMAT = 1
"""Version of the file format; a file of another version is refused."""

METHOD = 5
"""Version of how the numbers are measured (hethub.profiler.measure); a file of an older method
reads, but is measured anew where hethub measures (it would price a run differently) and noted
where given. 1: files without the field (trimmed means, 4 chained layers, unbound ranks); 2: plain
means, 8 chained layers, the all-reduce as the bucketed gradient sync runs it, each measuring
process bound to its cores and in a session of its own, as a run's ranks are; 3: the fused layer
(no region Functions at TP 1, torch's RMSNorm, rotary tables once a stage), the optimizer as the
runtime steps it (fused AdamW over the rank's flat fp32 weights), device events with no
synchronize between a forward and its backward; 4: one QKV and one gate|up GEMM, SwiGLU keeping
only the GEMM's output, RMSNorm keeping its input and fp32 statistics on the CPU too (torch's
fused kernel elsewhere), so a layer's time and saved bytes differ from method 3's; 5: ranks
measuring at once keep computing, untimed, until the last has finished its timed passes, so no
rank's last passes run with the cores to themselves, and a layer profile records its passes'
spread (layer_time_spread); and full recomputation checkpoints
each layer on its own, as the runtime now does."""
DTYPE_BYTES = {
    Precision.FP32.value: Precision.FP32.element_bytes,
    Precision.BF16.value: Precision.BF16.element_bytes,
    "fp16": 2,  # no plan's precision, but a file of it reads
}
"""Bytes of one element of each dtype a layer profile may be measured in: a plan's precision's
compute dtype (spec.plan.Precision) is looked up under its name."""
LAYER, LINK = "layer", "link"


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredOn:
    """Where a profile was measured and how busy the machine was: what tells, when a run's steps
    and its prediction disagree, whether the profile is another machine's or another moment's.
    A file measured before these were recorded has none (a profile's ``measured_on`` None)."""

    host: str
    """The host's name (socket.gethostname)."""
    cpu: str
    """The CPU's model (/proc/cpuinfo's "model name", else platform.processor)."""
    gpu: str | None = None
    """The GPU's name where it was measured on one (torch.cuda.get_device_name), else None."""
    torch: str | None = None
    """torch.__version__."""
    torch_build: str | None = None
    """What torch was built for: "cuda 12.4", "hip 6.2" or "cpu"."""
    load_before: float | None = None
    """The 1-minute load average as the measurement started (os.getloadavg; None: none)."""
    load_after: float | None = None
    """And as it ended (the measuring processes' own work included)."""


def layer_variant(model: ModelSpec) -> str:
    """How ``model``'s layer differs in its work from its arch's own (spec.model.arch_defaults):
    the biases it adds or lacks and its activation, '+'-joined ("qkv-bias" for Qwen2,
    "gelu-tanh" for GPT-2), "" for none. A tied head, the norm's epsilon and the rotary's
    frequencies cost the same, so they are not in it."""
    defaults = arch_defaults(model.arch)
    marks = []
    for bias in ("qkv_bias", "o_bias"):
        if getattr(model, bias) != defaults[bias]:
            marks.append(bias if getattr(model, bias) else f"no-{bias}")
    if model.activation != defaults["activation"]:
        marks.append(model.activation)
    return "+".join(marks).replace("_", "-")


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerKey:
    """What a layer profile was measured for; two keys match only if every field is equal."""

    device: str
    """Accelerator name of the cluster group that runs it (e.g. "cpu")."""
    arch: str
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    seq_len: int
    vocab: int
    """The embedding's and the head's cost depend on it."""
    dtype: str
    """fp32 | bf16 | fp16: the dtype the layer computed in."""
    threads: int
    """Torch threads per rank."""
    concurrent_ranks: int
    """Ranks of the job that computed at the same time on the profiled machine (4 ranks on a
    2-core machine share its cores); never below tp, whose ranks always compute together."""
    tp: int
    micro_batch: int
    variant: str = ""
    """What the layer runs besides its arch's own (layer_variant): "" for hethub's GPT and Llama
    layers, so that files measured before the field existed keep their key."""

    @classmethod
    def of(
        cls,
        model: ModelSpec,
        *,
        device: str,
        dtype: str,
        threads: int,
        concurrent_ranks: int,
        tp: int,
        micro_batch: int,
    ) -> LayerKey:
        """The key of ``model``'s layers under these conditions (concurrency raised to ``tp``)."""
        return cls(
            device=device,
            arch=model.arch,
            hidden=model.hidden,
            heads=model.heads,
            kv_heads=model.kv_heads,
            ffn_hidden=model.ffn_hidden,
            seq_len=model.seq_len,
            vocab=model.vocab,
            dtype=dtype,
            threads=threads,
            concurrent_ranks=max(concurrent_ranks, tp),
            tp=tp,
            micro_batch=micro_batch,
            variant=layer_variant(model),
        )

    def file_name(self) -> str:
        variant = f"-{self.variant}" if self.variant else ""
        return _file_name(
            LAYER,
            self.device,
            f"{self.arch}{variant}-h{self.hidden}-a{self.heads}-kv{self.kv_heads}"
            f"-f{self.ffn_hidden}-s{self.seq_len}-v{self.vocab}-{self.dtype}-t{self.threads}"
            f"-c{self.concurrent_ranks}-tp{self.tp}-mb{self.micro_batch}",
        )

    def describe(self) -> str:
        """One readable line: 'cpu tp=2 micro-batch 4 (llama hidden 256, ..., fp32, 1 thread,
        2 ranks at once)'."""
        return (
            f"{self.device} tp={self.tp} micro-batch {self.micro_batch} "
            f"({self.arch}{' ' + self.variant if self.variant else ''} hidden {self.hidden}, "
            f"heads {self.heads}/{self.kv_heads}, "
            f"ffn {self.ffn_hidden}, seq {self.seq_len}, vocab {self.vocab}, "
            f"{self.dtype}, {plural(self.threads, 'thread')}, "
            f"{plural(self.concurrent_ranks, 'rank')} at once)"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerProfile:
    """Measured costs of one micro-batch on one TP rank.

    Layer times include the layer's TP collectives (measured in a real process group of tp
    ranks); the head is the final norm, the vocabulary-parallel output projection and the
    vocabulary-parallel cross-entropy; backward times are without recomputation.
    """

    key: LayerKey
    layer_forward_s: float
    layer_backward_s: float
    embed_forward_s: float
    embed_backward_s: float
    head_forward_s: float
    head_backward_s: float
    optimizer_s_per_param: float
    """AdamW step, seconds per parameter of this rank."""
    layer_activation_bytes: int
    """Bytes one layer saves for its backward (its input included, its weights not)."""
    layer_param_bytes: int
    """Bytes of one layer's parameters on this rank."""
    measured_at: str
    """When (ISO 8601), for the record."""
    cores: int | None = None
    """CPU cores the measuring processes could run on (None: not recorded): with more ranks at
    once than cores, the ranks shared them while they were measured (predictor.sharing)."""
    layer_recompute_forward_s: float | None = None
    """A layer's forward under full recomputation (activation checkpointing: nothing kept)."""
    layer_recompute_backward_s: float | None = None
    """Its backward, the forward it runs again included (None: not measured; the predictor then
    takes forward + backward)."""
    method: int = METHOD
    """How it was measured (METHOD)."""
    layer_time_spread: float = 0.0
    """The variance of a chain of layers' pass time (forward and backward) over its mean, in
    seconds (profiler.measure.Passes): how much the scheduler makes an operation's time vary
    where ranks share the cores. 0: not measured (before method 5)."""
    layer_time_cv: float | None = None
    """The passes' coefficient of variation (standard deviation over mean): how far one repeat
    strayed from another, whatever the layer's size (None: not recorded)."""
    measured_on: MeasuredOn | None = None
    """Where and under what load it was measured (None: not recorded)."""


MEASURED_TIMES = tuple(
    f.name for f in dataclasses.fields(LayerProfile) if f.name.endswith(("_s", "_s_per_param"))
)
"""The seconds a layer profile holds, read off its fields: what the profiler measures and a
profile file must hold."""
_OPTIONAL_TIMES = tuple(
    f.name
    for f in dataclasses.fields(LayerProfile)
    if f.name in MEASURED_TIMES and f.default is not dataclasses.MISSING
)
"""The times a file written before they were measured lacks (the recomputed layer's)."""
_LAYER_TIMES = tuple(name for name in MEASURED_TIMES if name not in _OPTIONAL_TIMES)


Fit = tuple[float, float]
"""(latency_s, bytes_per_s) of a collective or a message: time = latency + bytes / bandwidth."""
Points = tuple[tuple[int, float], ...]
"""(bytes, seconds) as measured, by increasing size."""
COMMUNICATIONS = ("p2p", "allreduce", "broadcast", "allgather", "reducescatter")
COLLECTIVES = COMMUNICATIONS[1:]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProfile:
    """Measured speed of point-to-point messages and collectives between processes of one machine,
    or (``peer`` set) of messages between two nodes.

    Collectives are keyed by the number of ranks taking part; ``bytes`` is always the size of the
    whole tensor (the all-gather's output). Measured with ``concurrent_ranks`` processes present,
    as many disjoint groups communicating at once as fit in them. A time is interpolated between
    the measured sizes (``points``: gloo's times are not linear in the size between a few KB and
    a few MB), and from the fitted line beyond them.
    """

    device: str
    concurrent_ranks: int
    p2p_latency_s: float
    p2p_bytes_per_s: float
    allreduce: dict[int, Fit]
    broadcast: dict[int, Fit]
    allgather: dict[int, Fit]
    measured_at: str
    reducescatter: dict[int, Fit] = field(default_factory=dict)
    """Empty in a file measured before the sharded optimizer's reduce-scatter was (method 2)."""
    points: dict[tuple[str, int], Points] = field(default_factory=dict)
    """Measured (bytes, seconds) per (p2p|allreduce|broadcast|allgather|reducescatter, ranks);
    p2p has ranks 2."""
    method: int = METHOD
    """How it was measured (METHOD)."""
    peer: str | None = None
    """None: processes of one machine of ``device``. Else the link between a node of ``device``
    and another node of ``peer`` (the same name: two nodes of one kind; another: two groups'
    nodes, through the host-staged bridge where their vendors differ), measured by
    ``hethub profile --cluster`` with one process on each node; point to point only, and looked
    up by the pair of kinds (Profiles.link_between), whatever the concurrency."""
    measured_on: MeasuredOn | None = None
    """Where and under what load it was measured (None: not recorded)."""

    def __hash__(self) -> int:
        return hash((self.device, self.peer, self.concurrent_ranks, self.measured_at))

    def file_name(self) -> str:
        if self.peer is not None:
            return _file_name(LINK, self.device, f"to-{_UNSAFE.sub('_', self.peer)}-nodes")
        return _file_name(LINK, self.device, f"c{self.concurrent_ranks}")

    @property
    def pair(self) -> tuple[str, str]:
        """The kinds at its two ends, in order (a link between nodes is the same either way)."""
        return node_pair(self.device, self.peer or self.device)

    def p2p_time(self, nbytes: float) -> float:
        """One message of ``nbytes`` from one process to another."""
        return _time(
            (self.p2p_latency_s, self.p2p_bytes_per_s), self.points.get(("p2p", 2)), nbytes
        )

    def allreduce_time(self, nbytes: float, ranks: int) -> float | None:
        """All-reduce of an ``nbytes`` tensor over ``ranks`` ranks (None: not measured)."""
        return self._collective("allreduce", nbytes, ranks)

    def broadcast_time(self, nbytes: float, ranks: int) -> float | None:
        return self._collective("broadcast", nbytes, ranks)

    def allgather_time(self, nbytes: float, ranks: int) -> float | None:
        """All-gather whose gathered output is ``nbytes``."""
        return self._collective("allgather", nbytes, ranks)

    def reducescatter_time(self, nbytes: float, ranks: int) -> float | None:
        """Reduce-scatter of an ``nbytes`` tensor (the input, each rank keeping 1/ranks of the
        sum) over ``ranks`` ranks (None: not measured)."""
        return self._collective("reducescatter", nbytes, ranks)

    def _collective(self, kind: str, nbytes: float, ranks: int) -> float | None:
        if ranks <= 1:
            return 0.0
        fit = getattr(self, kind).get(ranks)
        return None if fit is None else _time(fit, self.points.get((kind, ranks)), nbytes)


def node_pair(a: str, b: str) -> tuple[str, str]:
    """The key of the link between a node of kind ``a`` and one of kind ``b``."""
    return (a, b) if a <= b else (b, a)


def _time(fit: Fit, points: Points | None, nbytes: float) -> float:
    """Interpolated between measured points (the smallest one's time below them), the fitted
    bandwidth beyond the largest; the fitted line without points."""
    if not points:
        return fit[0] + nbytes / fit[1]
    if nbytes <= points[0][0]:
        return points[0][1]
    for (n0, t0), (n1, t1) in itertools.pairwise(points):
        if nbytes <= n1:
            return t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)
    n, t = points[-1]
    return t + (nbytes - n) / fit[1]


@dataclass(frozen=True, slots=True)
@hashed_once(
    # Its dicts cannot be hashed: their keys stand for them (equal Profiles have equal keys).
    key=lambda p: (
        p.source,
        p.dtype,
        p.threads,
        p.concurrent_ranks,
        frozenset(p.layers),
        frozenset(p.links),
        frozenset(p.between),
    )
)
class Profiles:
    """The profiles of one directory, and the run conditions a prediction selects them under.

    Hashed once (predictor and planner caches are keyed on it). ``select`` fixes the conditions
    a job runs under; ``layer_for`` and ``link_for`` then look up by device and shape.
    """

    layers: dict[LayerKey, LayerProfile]
    links: dict[tuple[str, int], LinkProfile]
    source: str = ""
    dtype: str = "fp32"
    threads: int = 1
    concurrent_ranks: int = 1
    """Ranks of the job computing at once on one machine (1: each rank has its device to itself)."""
    between: dict[tuple[str, str], LinkProfile] = field(default_factory=dict)
    """Links between two nodes, by the pair of their kinds (node_pair)."""

    def select(
        self, *, dtype: str = "fp32", threads: int = 1, concurrent_ranks: int = 1
    ) -> Profiles:
        """The same profiles, looked up under these run conditions."""
        if dtype not in DTYPE_BYTES:
            raise HethubError(f"dtype = {dtype!r}: must be one of {', '.join(DTYPE_BYTES)}")
        if threads <= 0 or concurrent_ranks <= 0:
            raise HethubError(
                f"threads = {threads}, concurrent_ranks = {concurrent_ranks}: must be positive"
            )
        return dataclasses.replace(
            self, dtype=dtype, threads=threads, concurrent_ranks=concurrent_ranks
        )

    @property
    def bytes_per_element(self) -> int:
        """Activations' and gradients' element size under the selected dtype."""
        return DTYPE_BYTES[self.dtype]

    def layer(self, key: LayerKey) -> LayerProfile | None:
        """The profile measured for exactly ``key``, or None."""
        return self.layers.get(key)

    def layer_key(self, device: str, model: ModelSpec, tp: int, micro_batch: int) -> LayerKey:
        """The key a layer of ``model`` on ``device`` is looked up by under the selected
        conditions."""
        return LayerKey.of(
            model,
            device=device,
            dtype=self.dtype,
            threads=self.threads,
            concurrent_ranks=self.concurrent_ranks,
            tp=tp,
            micro_batch=micro_batch,
        )

    def layer_for(
        self, device: str, model: ModelSpec, tp: int, micro_batch: int
    ) -> LayerProfile | None:
        return self.layers.get(self.layer_key(device, model, tp, micro_batch))

    def link(self, device: str, concurrent_ranks: int) -> LinkProfile | None:
        return self.links.get((device, concurrent_ranks))

    def link_for(self, device: str) -> LinkProfile | None:
        """The link profile of ``device`` under the selected concurrency."""
        return self.links.get((device, self.concurrent_ranks))

    def link_between(self, a: str, b: str) -> LinkProfile | None:
        """The measured link between a node of kind ``a`` and one of kind ``b``, or None."""
        return self.between.get(node_pair(a, b))

    def merged(self, profiles: list[LayerProfile | LinkProfile]) -> Profiles:
        """These profiles with ``profiles`` added (replacing any of the same key)."""
        layers, links, between = dict(self.layers), dict(self.links), dict(self.between)
        for p in profiles:
            if isinstance(p, LayerProfile):
                layers[p.key] = p
            elif p.peer is not None:
                between[p.pair] = p
            else:
                links[(p.device, p.concurrent_ranks)] = p
        return dataclasses.replace(self, layers=layers, links=links, between=between)


def empty_profiles(source: str = "") -> Profiles:
    return Profiles(layers={}, links={}, source=source)


def all_cpu(cluster: ClusterSpec) -> bool:
    """Every group's accelerator is a CPU: a local run puts every rank on this machine's cores."""
    return all(g.accelerator.vendor == "cpu" for g in cluster.groups)


def local_concurrency(cluster: ClusterSpec, devices: int) -> int:
    """Ranks computing at once on one machine in a run of ``devices`` devices of ``cluster``: all of
    them when every group's accelerator is a CPU (a local run, every rank on this machine's
    cores), else 1 (each rank has its accelerator to itself)."""
    return devices if all_cpu(cluster) else 1


def select_for_run(
    profiles: Profiles, cluster: ClusterSpec, devices: int, dtype: str = "fp32"
) -> Profiles:
    """``profiles`` under the conditions of a runtime job on ``cluster``: ``dtype`` (the plan's
    precision; fp32 where a caller names none), one thread per rank, and the concurrency of
    local_concurrency()."""
    return profiles.select(
        dtype=dtype, threads=1, concurrent_ranks=local_concurrency(cluster, devices)
    )


# --- files -------------------------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _file_name(kind: str, device: str, rest: str) -> str:
    return f"{kind}-{_UNSAFE.sub('_', device)}-{rest}.json"


def profile_path(directory: str | Path, profile: LayerProfile | LinkProfile) -> Path:
    """Where ``save_profile`` writes ``profile`` in ``directory``."""
    return Path(directory) / (
        profile.key.file_name() if isinstance(profile, LayerProfile) else profile.file_name()
    )


def to_json(profile: LayerProfile | LinkProfile) -> dict[str, Any]:
    """The object a profile file holds."""
    if isinstance(profile, LayerProfile):
        data = dataclasses.asdict(profile)
        for name in ("layer_time_cv", "measured_on"):  # not recorded: absent, as in older files
            if data[name] is None:
                del data[name]
        if not profile.key.variant:  # the arch's own layer: its key as before the field existed
            del data["key"]["variant"]
        return {"format": FORMAT, "kind": LAYER, **data}
    data = dataclasses.asdict(profile)
    if profile.peer is None:  # a link inside a machine: its file as before the field existed
        del data["peer"]
    if profile.measured_on is None:
        del data["measured_on"]
    for name in COLLECTIVES:
        data[name] = {
            str(ranks): {"latency_s": fit[0], "bytes_per_s": fit[1]}
            for ranks, fit in sorted(getattr(profile, name).items())
        }
    data["points"] = {
        kind: {
            str(ranks): [list(p) for p in points]
            for (k, ranks), points in sorted(profile.points.items())
            if k == kind
        }
        for kind in COMMUNICATIONS
    }
    return {"format": FORMAT, "kind": LINK, **data}


def save_profile(directory: str | Path, profile: LayerProfile | LinkProfile) -> Path:
    """Write ``profile`` to its own file in ``directory`` (created if need be), atomically: a
    reader never sees half a file. Returns the file's path."""
    path = profile_path(directory, profile)
    text = json.dumps(to_json(profile), indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    except OSError as error:
        raise HethubError(f"{path}: cannot write the profile ({error.strerror})") from None
    return path


def load_profiles(directory: str | Path) -> Profiles:
    """Every profile file (``*.json``) of ``directory``; a missing directory, a malformed file or
    two files of one key are errors naming the directory, the file and the field."""
    folder = Path(directory)
    if not folder.is_dir():
        raise HethubError(
            f"{folder}: profile directory not found (write one with: hethub profile --out {folder})"
        )
    layers: dict[LayerKey, LayerProfile] = {}
    links: dict[tuple[str, int], LinkProfile] = {}
    between: dict[tuple[str, str], LinkProfile] = {}
    origin: dict[Any, Path] = {}
    for path in sorted(folder.glob("*.json")):
        profile = read_profile(path)
        if isinstance(profile, LayerProfile):
            key: Any = profile.key
        elif profile.peer is not None:
            key = ("between", *profile.pair)
        else:
            key = (profile.device, profile.concurrent_ranks)
        if key in origin:
            raise HethubError(
                f"{path}: measures the same key as {origin[key].name}; keep one of the two files"
            )
        origin[key] = path
        if isinstance(profile, LayerProfile):
            layers[key] = profile
        elif profile.peer is not None:
            between[profile.pair] = profile
        else:
            links[key] = profile
    return Profiles(layers=layers, links=links, source=str(folder), between=between)


class NonFiniteNumber(ValueError):
    """NaN, Infinity or -Infinity in a profile file: Python's json reads them, JSON has none."""


def _refuse_non_finite(constant: str) -> float:
    """json.loads' hook for NaN, Infinity and -Infinity: refused, so that no measured figure
    (nor a point of a measured curve, which Fields does not see one by one) is ever one."""
    raise NonFiniteNumber(constant)


def read_profile(path: str | Path) -> LayerProfile | LinkProfile:
    """One profile file, validated field by field."""
    path = Path(path)
    source = str(path)
    try:
        data = json.loads(path.read_text(), parse_constant=_refuse_non_finite)
    except (OSError, UnicodeDecodeError) as error:
        raise HethubError(
            f"{path}: cannot read the profile file ({getattr(error, 'strerror', None) or error})"
        ) from None
    except json.JSONDecodeError as error:
        raise HethubError(
            f"{path}: not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    except NonFiniteNumber as error:
        raise HethubError(
            f"{path}: {error} is not a number a profile holds (every figure is finite); "
            f"measure again"
        ) from None
    top = Fields(data, source)
    if top.raw("format") != FORMAT:
        raise top.error(
            "format", top.raw("format"), f"this hethub reads profile format {FORMAT}; measure again"
        )
    kind = top.choice("kind", (LAYER, LINK))
    if kind == LAYER:
        return _parse_layer(data, source)
    return _parse_link(data, source)


def _parse_layer(data: dict, source: str) -> LayerProfile:
    fields = Fields(
        data,
        source,
        allowed=(
            "format",
            "kind",
            "key",
            *_LAYER_TIMES,
            *_OPTIONAL_TIMES,
            "layer_activation_bytes",
            "layer_param_bytes",
            "measured_at",
            "cores",
            "method",
            "layer_time_spread",
            "layer_time_cv",
            "measured_on",
        ),
    )
    k = Fields(
        fields.raw("key"), source, "key", allowed=[f.name for f in dataclasses.fields(LayerKey)]
    )
    key = LayerKey(
        device=k.string("device"),
        arch=k.choice("arch", ARCHS),
        hidden=k.positive_int("hidden"),
        heads=k.positive_int("heads"),
        kv_heads=k.positive_int("kv_heads"),
        ffn_hidden=k.positive_int("ffn_hidden"),
        seq_len=k.positive_int("seq_len"),
        vocab=k.positive_int("vocab"),
        dtype=k.choice("dtype", DTYPE_BYTES),
        threads=k.positive_int("threads"),
        concurrent_ranks=k.positive_int("concurrent_ranks"),
        tp=k.positive_int("tp"),
        micro_batch=k.positive_int("micro_batch"),
        variant=k.string("variant") if k.has("variant") else "",
    )
    if key.concurrent_ranks < key.tp:
        raise k.error("concurrent_ranks", key.concurrent_ranks, f"must be at least tp ({key.tp})")
    times = {name: _finite_positive(fields, name) for name in _LAYER_TIMES}
    return LayerProfile(
        key=key,
        **times,
        layer_activation_bytes=fields.positive_int("layer_activation_bytes"),
        layer_param_bytes=fields.positive_int("layer_param_bytes"),
        measured_at=fields.string("measured_at"),
        cores=fields.positive_int("cores") if fields.has("cores") else None,
        method=_method(fields),
        **{name: _finite_positive(fields, name) for name in _OPTIONAL_TIMES if fields.has(name)},
        layer_time_spread=(
            _finite_non_negative(fields, "layer_time_spread")
            if fields.has("layer_time_spread")
            else 0.0
        ),
        layer_time_cv=(
            _finite_non_negative(fields, "layer_time_cv") if fields.has("layer_time_cv") else None
        ),
        measured_on=_measured_on(fields),
    )


def _parse_link(data: dict, source: str) -> LinkProfile:
    fields = Fields(
        data,
        source,
        allowed=(
            "format",
            "kind",
            "device",
            "concurrent_ranks",
            "p2p_latency_s",
            "p2p_bytes_per_s",
            "allreduce",
            "broadcast",
            "allgather",
            "reducescatter",
            "measured_at",
            "points",
            "method",
            "peer",
            "measured_on",
        ),
    )
    # A file measured before the reduce-scatter was (method 2) has none: measured anew where
    # profiles are ensured; meanwhile a sharded stage's sync is priced by the analytic model.
    collectives = {
        name: _fits(fields, name)
        for name in COLLECTIVES
        if name != "reducescatter" or fields.has(name)
    }
    return LinkProfile(
        device=fields.string("device"),
        concurrent_ranks=fields.positive_int("concurrent_ranks"),
        p2p_latency_s=_finite_non_negative(fields, "p2p_latency_s"),
        p2p_bytes_per_s=_finite_positive(fields, "p2p_bytes_per_s"),
        **collectives,
        measured_at=fields.string("measured_at"),
        points=_points(fields),
        method=_method(fields),
        peer=fields.string("peer") if fields.has("peer") else None,
        measured_on=_measured_on(fields),
    )


def _measured_on(fields: Fields) -> MeasuredOn | None:
    """Where the file says it was measured: None in a file written before it was recorded."""
    if not fields.has("measured_on"):
        return None
    names = [f.name for f in dataclasses.fields(MeasuredOn)]
    where = Fields(fields.raw("measured_on"), fields.source, "measured_on", allowed=names)

    def text(name: str) -> str | None:
        return where.string(name) if where.has(name) else None

    def load(name: str) -> float | None:
        return _finite_non_negative(where, name) if where.has(name) else None

    return MeasuredOn(
        host=where.string("host"),
        cpu=where.string("cpu"),
        gpu=text("gpu"),
        torch=text("torch"),
        torch_build=text("torch_build"),
        load_before=load("load_before"),
        load_after=load("load_after"),
    )


def _method(fields: Fields) -> int:
    """The file's measuring method: 1 where it predates the field."""
    return fields.positive_int("method") if fields.has("method") else 1


def _points(fields: Fields) -> dict[tuple[str, int], Points]:
    """The measured points, if the file has them: sizes increasing, times positive."""
    if not fields.has("points"):
        return {}
    top = Fields(fields.raw("points"), fields.source, "points", allowed=COMMUNICATIONS)
    out: dict[tuple[str, int], Points] = {}
    for kind in COMMUNICATIONS:
        if not top.has(kind):
            continue
        per_ranks = top.raw(kind)
        if not isinstance(per_ranks, dict):
            raise top.error(
                kind, per_ranks, "must be a mapping of rank counts to [[bytes, seconds], ...]"
            )
        for ranks, raw in per_ranks.items():
            where = f"{kind}.{ranks}"
            if not str(ranks).isdigit() or int(ranks) < 2:
                raise top.error(where, raw, "keys are rank counts of at least 2")
            ok = (
                isinstance(raw, list)
                and raw
                and all(
                    isinstance(p, list)
                    and len(p) == 2
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in p)
                    and p[0] > 0
                    and 0 < p[1] < math.inf
                    for p in raw
                )
            )
            if not ok or any(a[0] >= b[0] for a, b in itertools.pairwise(raw)):
                raise top.error(
                    where,
                    raw if len(str(raw)) < 60 else "[...]",
                    "must be [[bytes, seconds], ...] with positive values and sizes increasing",
                )
            out[(kind, int(ranks))] = tuple((int(n), float(t)) for n, t in raw)
    return out


def _fits(fields: Fields, name: str) -> dict[int, Fit]:
    raw = fields.raw(name)
    if not isinstance(raw, dict):
        raise fields.error(
            name, raw, "must be a mapping of rank counts to {latency_s, bytes_per_s}"
        )
    out: dict[int, Fit] = {}
    for ranks, value in raw.items():
        if not str(ranks).isdigit() or int(ranks) < 2:
            raise fields.error(f"{name}.{ranks}", value, "keys are rank counts of at least 2")
        fit = Fields(
            value,
            fields.source,
            fields.path(f"{name}.{ranks}"),
            allowed=("latency_s", "bytes_per_s"),
        )
        out[int(ranks)] = (
            _finite_non_negative(fit, "latency_s"),
            _finite_positive(fit, "bytes_per_s"),
        )
    return out


def _finite_positive(fields: Fields, name: str) -> float:
    value = fields.positive_number(name)
    if not math.isfinite(value):
        raise SpecError(fields.source, fields.path(name), value, "must be a finite positive number")
    return value


def _finite_non_negative(fields: Fields, name: str) -> float:
    value = fields.raw(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise fields.error(name, value, "must be a finite non-negative number")
    return float(value)
