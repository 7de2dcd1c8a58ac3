"""A Kubernetes JobSet (jobset.x-k8s.io/v1alpha2) that trains a plan: one replicated job per
group, whose Indexed Job runs one pod per node, each pod one agent (agents.py) that knows its
node from its completion index. A ConfigMap beside it carries the cluster and plan files; the
run folder is a volume claim every pod mounts. The same mapping as the Slurm job (slurm.py):
group -> component, node -> task, SLURM_NODEID -> JOB_COMPLETION_INDEX."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import PurePosixPath

import yaml

from hethub.errors import HethubError
from hethub.launchers.agents import Launch, indexed_agent_command, start_lines
from hethub.spec.cluster import ClusterSpec, DeviceGroup, KubernetesSettings
from hethub.spec.fields import parse_yaml

FILES_MOUNT = "/etc/hethub"
"""Where every pod finds the ConfigMap's cluster.yaml and plan.yaml."""
DNS_LABEL = 63
"""The longest name of a Kubernetes DNS label: a pod's host name is one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSetJob:
    """What the flags give every group: an image for those whose kubernetes: section lacks one
    (None: no --image), the claim that holds the run folder, and the grace time between SIGTERM
    and SIGKILL."""

    image: str | None
    volume_claim: str
    grace_s: int


@functools.cache
def device_plugins() -> dict[str, str]:
    """Each vendor's device plugin resource (hethub/data/device_plugins.yaml)."""
    text = resources.files("hethub.data").joinpath("device_plugins.yaml").read_text()
    return parse_yaml(text, "device_plugins.yaml")


def kubernetes_name(text: str) -> str:
    """``text`` as a DNS label: lower case, each run of other characters one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def jobset_manifest(
    launch: Launch, cluster: ClusterSpec, job: JobSetJob, files: dict[str, str]
) -> str:
    """The ConfigMap of ``files`` (cluster.yaml, plan.yaml: their texts) and the JobSet, as one
    YAML stream for `kubectl apply -f`."""
    name = kubernetes_name(launch.name)
    jobs = _job_names(launch, name)
    first = launch.groups[0]
    endpoint = f"{name}-{jobs[first]}-0-0.{name}:{launch.port}"
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-files"},
        "data": files,
    }
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            # a failed pod fails its Job (backoffLimit 0), and the JobSet starts every Job again
            # (the workers inside a pod restart under torchrun's own --max-restarts first)
            "failurePolicy": {"maxRestarts": launch.max_restarts},
            # pods reachable as NAME-JOB-0-INDEX.NAME: the agents meet at the first group's pod 0
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [
                _replicated_job(launch, cluster.group(group), jobs[group], endpoint, job, name)
                for group in launch.groups
            ],
        },
    }
    run_name = PurePosixPath(launch.run_dir).name
    header = "\n".join(
        [
            "# A Kubernetes JobSet written by `hethub launch`: one replicated job per group, one",
            "# pod per node, each running one hethub agent (torchrun, with `hethub train` as its",
            "# workers); the ConfigMap before it carries the cluster and plan files. Apply both",
            "# with `kubectl apply -f` on a cluster with the JobSet controller installed.",
            f"# The run folder is the folder {run_name} of the volume claim {job.volume_claim},",
            f"# mounted at {launch.run_dir} in every pod: ReadWriteMany storage (a shared file",
            "# system), where a restarted or re-applied JobSet resumes from the newest checkpoint.",
        ]
    )
    documents = yaml.dump_all([config_map, jobset], Dumper=_Dumper, sort_keys=False, width=100)
    return f"{header}\n{documents}"


def _job_names(launch: Launch, name: str) -> dict[str, str]:
    """Each group's replicated job name: its name as a DNS label, unique, with room for the
    JobSet's name and the indices in its pods' host names."""
    jobs: dict[str, str] = {}
    for group in launch.groups:
        label = kubernetes_name(group)
        if not label or label in jobs.values():
            raise HethubError(
                f"group {group}: its Kubernetes name {label!r} is empty or another group's: a "
                "replicated job's name is the group's in lower case letters, digits and '-'"
            )
        host = f"{name}-{label}-0-{len(launch.group_nodes(group)) - 1}"
        if len(host) > DNS_LABEL:
            raise HethubError(
                f"group {group}: its pods' host name {host!r} is {len(host)} characters, over "
                f"Kubernetes' {DNS_LABEL}: give the run folder or the group a shorter name"
            )
        jobs[group] = label
    return jobs


def _replicated_job(
    launch: Launch, group: DeviceGroup, job_name: str, endpoint: str, job: JobSetJob, name: str
) -> dict:
    nodes = launch.group_nodes(group.name)
    settings = group.kubernetes or KubernetesSettings()
    image = settings.image or job.image
    if image is None:
        raise HethubError(
            f"group {group.name}: no container image: give 'image' in its kubernetes: section "
            "of the cluster file, or --image (one with hethub and this vendor's torch build)"
        )
    run_name = PurePosixPath(launch.run_dir).name
    command = indexed_agent_command(launch, group.name, "JOB_COMPLETION_INDEX", '"${START[@]}"')
    asked = [line for line in launch.environment(group.name).lines() if line.startswith("#")]
    script = "\n".join(["set -euo pipefail", *asked, start_lines(launch), command, ""])
    container = {
        "name": "agent",
        "image": image,
        "command": ["bash", "-c", script],
        "env": [
            {"name": "RDZV_ENDPOINT", "value": endpoint},
            {
                "name": "RESTART_ATTEMPT",
                "valueFrom": {
                    "fieldRef": {
                        "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"
                    }
                },
            },
            # each start of the JobSet meets afresh
            {"name": "RDZV_ID", "value": f"{name}-$(RESTART_ATTEMPT)"},
        ],
        "ports": [{"name": "rendezvous", "containerPort": launch.port}],
        "resources": _resources(group, settings),
        "volumeMounts": [
            # the claim's folder of this run's name: one claim holds many runs
            {"name": "run", "mountPath": launch.run_dir, "subPath": run_name},
            {"name": "files", "mountPath": FILES_MOUNT, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},  # the workers' shared memory
        ],
    }
    pod = {
        "restartPolicy": "Never",
        # Kubernetes' SIGTERM before a preemption or a deletion reaches the agent (the
        # container's process: bash exec's it), whose workers checkpoint within this time
        "terminationGracePeriodSeconds": job.grace_s,
        "containers": [container],
        "volumes": [
            {"name": "run", "persistentVolumeClaim": {"claimName": job.volume_claim}},
            {"name": "files", "configMap": {"name": f"{name}-files"}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if settings.node_selector:
        pod["nodeSelector"] = dict(settings.node_selector)
    return {
        "name": job_name,
        "replicas": 1,
        "template": {
            "spec": {
                "parallelism": len(nodes),
                "completions": len(nodes),
                "completionMode": "Indexed",
                "backoffLimit": 0,
                "template": {"spec": pod},
            }
        },
    }


def _resources(group: DeviceGroup, settings: KubernetesSettings) -> dict:
    """A pod's devices: the group's whole node, as its vendor's device plugin counts them (a
    CPU group's as CPUs)."""
    devices = group.devices_per_node
    vendor = group.accelerator.vendor
    if vendor == "cpu":
        return {"requests": {"cpu": str(devices)}}
    resource = settings.device_resource or device_plugins().get(vendor)
    if resource is None:
        raise HethubError(
            f"group {group.name}: no Kubernetes resource for vendor {vendor}'s devices: give "
            "'device_resource' in its kubernetes: section (the name its device plugin advertises)"
        )
    return {"limits": {resource: devices}}


class _Dumper(yaml.SafeDumper):
    """Strings of several lines (the pods' scripts, the files) as literal blocks, as written."""


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _string)
