"""`hethub catalog`: the accelerators the catalog knows, with their public figures and the
microbenchmarked efficiency the predictor prices them at (a figure no benchmark measured for a
device is its vendor's default, and is marked so)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from hethub.report.terminal import render_table
from hethub.spec.accelerator import GIB, AcceleratorSpec, DeviceEfficiency, catalog

INHERITED = "*"
"""Marks a figure taken from the vendor's default, for want of a measurement of the device."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "catalog",
        help="list the accelerator catalog",
        description="List the accelerator catalog (names are case-insensitive).",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def _json(a: AcceleratorSpec) -> dict:
    fields = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.init}
    del fields["name"]
    fields["memory_gib"] = a.memory_bytes / GIB
    fields["usable_memory_gb"] = a.usable_memory_gb
    e: DeviceEfficiency = fields.pop("efficiency")
    fields["efficiency"] = {
        **{f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.init},
        "inherited": list(e.inherited),
        "gemm_sustained": e.gemm_sustained,
    }
    return fields


def _figure(e: DeviceEfficiency, name: str, text: str) -> str:
    return f"{text}{INHERITED}" if name in e.inherited else text


def run(args: argparse.Namespace) -> int:
    accelerators = catalog()
    if args.json:
        print(json.dumps({name: _json(a) for name, a in accelerators.items()}, indent=2))
        return 0
    header = [
        "name",
        "vendor",
        "bf16 TFLOP/s",
        "memory GiB",
        "usable GB",
        "memory GB/s",
        "intra-node GB/s",
        "network Gb/s",
        "GEMM",
        "sustained",
        "attention",
        "memory eff",
        "launch us",
        "source",
    ]
    rows = []
    for a in accelerators.values():
        e = a.efficiency
        rows.append(
            [
                a.name,
                a.vendor,
                f"{a.bf16_tflops:g}",
                f"{a.memory_bytes / GIB:g}",
                f"{a.usable_memory_gb:.1f}",
                f"{a.memory_bw_gb_s:g}",
                f"{a.intra_node_gb_s:g}",
                f"{a.network_gbps:g}",
                _figure(e, "gemm", f"{e.gemm:.3f}"),
                _figure(e, "sustained", f"{e.sustained:.3f}"),
                _figure(e, "attention", f"{e.attention:.2f}"),
                _figure(e, "memory", f"{e.memory:.2f}"),
                _figure(e, "launch_us", f"{e.launch_us:g}"),
                a.source,
            ]
        )
    print(render_table(header, rows))
    print(
        f"\nGEMM, sustained, attention and memory eff are the shares of the datasheet the "
        f"predictor prices each device at, from microbenchmarks (hethub catalog --json gives "
        f"each device's sources); {INHERITED} marks a figure no benchmark of the device "
        f"measured, taken from its vendor's default. Usable GB: the memory a job may hold, "
        f"in the predictor's decimal GB, the runtime's reserve kept (catalog.yaml, "
        f"vendor_defaults)."
    )
    return 0
