"""`hethub catalog`: the accelerators the catalog knows, with their public figures."""

from __future__ import annotations

import argparse
import dataclasses
import json

from hethub.report.terminal import render_table
from hethub.spec.accelerator import catalog


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "catalog",
        help="list the accelerator catalog",
        description="List the accelerator catalog (names are case-insensitive).",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    accelerators = catalog()
    if args.json:
        print(
            json.dumps(
                {
                    name: {
                        f.name: getattr(a, f.name)
                        for f in dataclasses.fields(a)
                        if f.init and f.name != "name"
                    }
                    for name, a in accelerators.items()
                },
                indent=2,
            )
        )
        return 0
    header = [
        "name",
        "vendor",
        "bf16 TFLOP/s",
        "memory GB",
        "memory GB/s",
        "intra-node GB/s",
        "network Gb/s",
        "source",
    ]
    rows = [
        [
            a.name,
            a.vendor,
            f"{a.bf16_tflops:g}",
            f"{a.memory_gb:g}",
            f"{a.memory_bw_gb_s:g}",
            f"{a.intra_node_gb_s:g}",
            f"{a.network_gbps:g}",
            a.source,
        ]
        for a in accelerators.values()
    ]
    print(render_table(header, rows))
    return 0
