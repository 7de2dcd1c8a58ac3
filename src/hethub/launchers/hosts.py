"""One shell script per node, for a cluster without a scheduler: each starts that node's agent
with its --this-node and the rendezvous endpoint."""

from __future__ import annotations

import shlex

from hethub.launchers.agents import Launch, agent_command, start_lines


def host_scripts(launch: Launch, endpoint: str) -> dict[str, str]:
    """Per node, in launch order: its file name (GROUP-INDEX.sh) and its script; ``endpoint``
    is HOST:PORT, where the agents meet."""
    scripts = {}
    for node in launch.nodes:
        name = f"{node.group}:{node.node}"
        command = agent_command(
            launch,
            node.group,
            processes=str(node.processes),
            this_node=shlex.quote(name),
            endpoint=shlex.quote(endpoint),
            rdzv_id=shlex.quote(launch.name),
            start='"${START[@]}"',
        )
        scripts[f"{node.group}-{node.node}.sh"] = "\n".join(
            [
                "#!/bin/bash",
                f"# Node {name}, one of {len(launch.nodes)}: run this on that node, each",
                f"# other node's script on its own; the agents meet at {endpoint}. Written by",
                "# `hethub launch`. This folder (the cluster and plan files beside it) and the",
                "# run folder must be on storage every node sees (shared storage).",
                "set -euo pipefail",
                f"# group {node.group}'s environment (vendor_env.yaml, then its launch: env)",
                *launch.environment(node.group).lines(),
                start_lines(launch),
                f"exec {command}",
                "",
            ]
        )
    return scripts
