"""Accelerators: the catalog of real devices and inline ones given in a cluster file."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from hethub.errors import SpecError
from hethub.spec.fields import Fields, field_names, parse_yaml, rules, suggestion
from hethub.spec.hashing import hashed_once

VENDORS = ("nvidia", "amd", "huawei", "intel", "cpu", "other")

GB = 10**9
"""The predictor's unit of memory (StageMemory's figures): decimal gigabytes."""
GIB = 2**30
"""A gibibyte: the unit device memory is built in (HBM and GDDR capacities are binary), whatever
a datasheet's "80 GB" says."""


@dataclass(frozen=True, kw_only=True, slots=True)
@hashed_once()
class DeviceEfficiency:
    """How much of its datasheet a device's kernels reach, each figure from a microbenchmark of
    that device (the catalog names it) or, where none is published, its vendor's default.

    A GEMM's time is its FLOPs at ``gemm`` of the dense peak plus the bytes it moves at
    ``memory`` of the bandwidth (a roofline: a thin GEMM, whose bytes per FLOP are many, runs
    far below ``gemm``; the narrow dimension where it reaches half of it follows from the
    device's FLOPs per byte, not from a fit)."""

    gemm: float = field(metadata=rules(fraction=True))
    """Fraction of the dense peak a large GEMM reaches in a burst: a GEMM benchmark's best shape
    (MAMF, the maximum achievable matmul FLOP/s, a mean of 100 runs at boost clock) over the
    datasheet figure."""
    sustained: float = field(metadata=rules(fraction=True))
    """Fraction of that burst rate a GEMM keeps once the device runs at its power limit, as a
    training step holds it (MSMF over MAMF: the maximum sustainable matmul FLOP/s, measured at
    the saturated clock)."""
    attention: float = field(metadata=rules(fraction=True))
    """Fraction of the dense peak the fused attention kernel (flash attention) reaches, forward
    and backward together, by its FLOPs."""
    memory: float = field(metadata=rules(fraction=True))
    """Fraction of the memory bandwidth a streaming kernel (copy, triad) reaches."""
    launch_us: float
    """The device runtime's cost to launch one kernel (an empty kernel's time back to back);
    the framework's dispatch comes on top of it (predictor.Calibration.dispatch_us)."""
    source: str
    """Where the figures come from."""
    inherited: tuple[str, ...] = ()
    """The figures taken from the vendor's default, for want of a measurement of the device."""

    @property
    def gemm_sustained(self) -> float:
        """Fraction of the dense peak a large GEMM sustains through a training step."""
        return self.gemm * self.sustained

    @property
    def attention_sustained(self) -> float:
        """Fraction of the dense peak flash attention sustains through a training step."""
        return self.attention * self.sustained


EFFICIENCY_FIELDS = tuple(
    name for name in field_names(DeviceEfficiency) if name not in ("source", "inherited")
)
"""The figures of a device's `efficiency:` in the catalog, each measured by a microbenchmark
(DeviceEfficiency's fields but its source and what it inherited)."""


@dataclass(frozen=True, kw_only=True, slots=True)
@hashed_once()
class AcceleratorSpec:
    """One kind of device, with the figures the predictor needs."""

    name: str
    """Catalog name (lower case) or the name an inline accelerator gives itself."""
    vendor: str = field(metadata=rules(choices=VENDORS))
    """nvidia | amd | huawei | intel | cpu | other; groups of different vendors talk over the
    bridge."""
    bf16_tflops: float
    """Dense bf16 tensor TFLOP/s (fp16 where the device has no bf16)."""
    fp32_tflops: float | None = None
    """Dense FP32 TFLOP/s, what an fp32 plan's GEMMs run at (None: no public figure; an fp32
    plan on this device is refused)."""
    memory_bytes: int
    """Device memory, bytes: the catalog's ``memory_gib`` or ``memory_gb``, whichever unit the
    figure is in."""
    memory_reserve_bytes: int = 0
    """What the device's runtime keeps of that memory, never the job's: what the driver does not
    expose, the runtime's context, the collective library's buffers and the allocator's slack
    (``memory_reserve_gib``, by default its vendor's in catalog.yaml's vendor_defaults)."""
    memory_bw_gb_s: float
    """Device memory bandwidth, GB/s."""
    intra_node_gb_s: float
    """Device-to-device link inside a node, GB/s per device per direction."""
    host_link_gb_s: float
    """Device-to-host link, GB/s per direction (the host-staged bridge crosses it)."""
    network_gbps: float
    """The usual node's scale-out network, Gbit/s per node."""
    source: str = ""
    """The public document the figures come from."""
    efficiency: DeviceEfficiency
    """How much of those figures its kernels reach (microbenchmarks, or the vendor's default)."""

    @property
    def memory_gb(self) -> float:
        """Device memory, decimal GB (the predictor's unit)."""
        return self.memory_bytes / GB

    @property
    def usable_memory_gb(self) -> float:
        """What a job may hold of the device's memory, decimal GB: its memory less the
        runtime's reserve. Whether a stage fits is asked of this alone
        (predictor.memory.fits)."""
        return (self.memory_bytes - self.memory_reserve_bytes) / GB

    def holds(self, gb: float) -> bool:
        """Whether one device holds ``gb`` decimal GB beside its runtime's reserve: the one
        rule of a fit (predictor.memory.fits, the planner, the pre-flight, the dry run)."""
        return gb <= self.usable_memory_gb


@functools.cache
def _catalog_data() -> dict[str, Any]:
    text = resources.files("hethub.data").joinpath("catalog.yaml").read_text()
    return parse_yaml(text, "catalog.yaml")


def catalog() -> dict[str, AcceleratorSpec]:
    """All catalog accelerators by lower-case name."""
    # Read as an inline accelerator is: every figure held to the rules of a cluster file's.
    return {
        name: parse_accelerator({"name": name, **fields}, "catalog.yaml", f"accelerators.{name}")
        for name, fields in _catalog_data()["accelerators"].items()
    }


def calibration_data() -> dict[str, float]:
    """The predictor's fitted physical parameters, as stored in the catalog file."""
    return dict(_catalog_data()["calibration"])


def lookup(name: str, source: str = "", field: str = "accelerator") -> AcceleratorSpec:
    """The catalog accelerator called ``name`` (case-insensitive); a near miss gets a suggestion."""
    known = catalog()
    key = str(name).strip().lower()
    if key not in known:
        raise SpecError(
            source,
            field,
            name,
            f"unknown accelerator{suggestion(key, known)}; known: {', '.join(known)}",
        )
    return known[key]


MEMORY_KEYS = ("memory_gb", "memory_gib", "memory_reserve_gib")
"""An inline accelerator's memory, in the unit of its figure: AcceleratorSpec's memory_bytes and
memory_reserve_bytes."""
INLINE_KEYS = (
    *(name for name in field_names(AcceleratorSpec) if not name.endswith("_bytes")),
    *MEMORY_KEYS,
)
"""An inline accelerator's keys: AcceleratorSpec's fields, its memory in a file's units."""
OWN_READERS = ("memory_bytes", "memory_reserve_bytes", "source", "efficiency")
"""AcceleratorSpec's fields read by a reader of their own: the memory in its unit, the source
(any text), the efficiency (a section with its vendor's defaults)."""


def parse_accelerator(value: Any, source: str, field: str) -> AcceleratorSpec:
    """A catalog name, or an inline mapping whose omitted figures come from its vendor's
    defaults."""
    if isinstance(value, str):
        return lookup(value, source, field)
    f = Fields(value, source, field, allowed=INLINE_KEYS)
    vendor = f.choice("vendor", VENDORS)
    defaults = _catalog_data()["vendor_defaults"][vendor]
    return AcceleratorSpec(
        **f.declared(AcceleratorSpec, skip=OWN_READERS, defaults=defaults),
        memory_bytes=_memory_bytes(f),
        memory_reserve_bytes=round(
            GIB * f.non_negative_number("memory_reserve_gib", defaults["memory_reserve_gib"])
        ),
        source=str(f.raw("source", "inline in the cluster file")),
        efficiency=parse_efficiency(f.raw("efficiency", {}), vendor, source, f.path("efficiency")),
    )


def _memory_bytes(f: Fields) -> int:
    """The device's memory from ``memory_gib`` or ``memory_gb``: one of them, in the unit its
    figure is (a datasheet's "80 GB" of HBM is 80 GiB: say memory_gib)."""
    if f.has("memory_gib") and f.has("memory_gb"):
        raise f.error(
            "memory_gb",
            f.raw("memory_gb"),
            "give the device's memory once: memory_gib (binary, as HBM and GDDR are built) or "
            "memory_gb (decimal), not both",
        )
    if f.has("memory_gib"):
        return round(GIB * f.positive_number("memory_gib"))
    if not f.has("memory_gb"):
        raise f.error(
            "memory_gib",
            None,
            "is required: the device's memory, as memory_gib (binary, as HBM and GDDR are "
            "built) or memory_gb (decimal)",
        )
    return round(GB * f.positive_number("memory_gb"))


def parse_efficiency(value: Any, vendor: str, source: str, field: str) -> DeviceEfficiency:
    """A device's `efficiency:` mapping; each figure it leaves out is its vendor's default (and
    is named as inherited, so that `hethub catalog` says which figures were not measured)."""
    f = Fields(value, source, field, allowed=(*EFFICIENCY_FIELDS, "source"))
    default = _catalog_data()["vendor_defaults"][vendor]["efficiency"]
    inherited = tuple(name for name in EFFICIENCY_FIELDS if not f.has(name))
    figures = f.declared(DeviceEfficiency, skip=("source", "inherited"), defaults=default)
    own = str(f.raw("source", "")) if len(inherited) < len(EFFICIENCY_FIELDS) else ""
    if inherited:
        said = f"{', '.join(inherited)}: {vendor}'s default ({default['source']})"
        own = f"{own}; {said}" if own else said
    return DeviceEfficiency(**figures, source=own, inherited=inherited)
