"""What a profile is: the keys and the measured figures of a layer and of a link, as the predictor
and the planner read them.

Pure Python (the predictor and the planner read profiles and import no torch). A layer profile is
keyed by everything its numbers depend on: the device kind, the layer's shape (and the vocabulary,
for the embedding and the head), the dtype, the threads per rank, how many ranks computed at once
on the machine, the TP degree and the micro-batch size. Lookups match the whole key exactly, so a
profile of another shape, thread count or concurrency is never used in its place.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field

from hethub.report.terminal import plural
from hethub.spec.fields import rules
from hethub.spec.model import ARCHS, ModelSpec, arch_defaults
from hethub.spec.plan import Precision

FORMAT = 1
"""Version of the file format; a file of another version is refused."""

METHOD = 5
"""Version of how the numbers are measured (hethub.profiler.layers, hethub.profiler.links); a file
of an older method reads, but is measured anew where hethub measures (it would price a run
differently) and noted where given. 1: files without the field (trimmed means, 4 chained layers,
unbound ranks); 2: plain means, 8 chained layers, the all-reduce as the bucketed gradient sync runs
it, each measuring process bound to its cores and in a session of its own, as a run's ranks are; 3:
the fused layer (no region Functions at TP 1, torch's RMSNorm, rotary tables once a stage), the
optimizer as the runtime steps it (fused AdamW over the rank's flat fp32 weights), device events
with no synchronize between a forward and its backward; 4: one QKV and one gate|up GEMM, SwiGLU
keeping only the GEMM's output, RMSNorm keeping its input and fp32 statistics on the CPU too
(torch's fused kernel elsewhere), so a layer's time and saved bytes differ from method 3's; 5: ranks
measuring at once keep computing, untimed, until the last has finished its timed passes, so no
rank's last passes run with the cores to themselves, and a layer profile records its passes' spread
(layer_time_spread); and full recomputation checkpoints each layer on its own, as the runtime now
does."""
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
    load_before: float | None = field(default=None, metadata=rules(at_least_zero=True))
    """The 1-minute load average as the measurement started (os.getloadavg; None: none)."""
    load_after: float | None = field(default=None, metadata=rules(at_least_zero=True))
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
    arch: str = field(metadata=rules(choices=ARCHS))
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    seq_len: int
    vocab: int
    """The embedding's and the head's cost depend on it."""
    dtype: str = field(metadata=rules(choices=DTYPE_BYTES))
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
    layer_time_spread: float = field(default=0.0, metadata=rules(at_least_zero=True))
    """The variance of a chain of layers' pass time (forward and backward) over its mean, in
    seconds (profiler.layers.Passes): how much the scheduler makes an operation's time vary
    where ranks share the cores. 0: not measured (before method 5)."""
    layer_time_cv: float | None = field(default=None, metadata=rules(at_least_zero=True))
    """The passes' coefficient of variation (standard deviation over mean): how far one repeat
    strayed from another, whatever the layer's size (None: not recorded)."""
    measured_on: MeasuredOn | None = None
    """Where and under what load it was measured (None: not recorded)."""


MEASURED_TIMES = tuple(
    f.name for f in dataclasses.fields(LayerProfile) if f.name.endswith(("_s", "_s_per_param"))
)
"""The seconds a layer profile holds, read off its fields: what the profiler measures and a
profile file must hold."""
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
    p2p_latency_s: float = field(metadata=rules(at_least_zero=True))
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


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
"""What a device's name may not put in a file name: replaced by '_'."""


def _file_name(kind: str, device: str, rest: str) -> str:
    return f"{kind}-{_UNSAFE.sub('_', device)}-{rest}.json"
