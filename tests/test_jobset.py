"""`hethub launch jobset`: the Kubernetes JobSet and ConfigMap it writes from a cluster and a plan.
The ConfigMap and each replicated job's Job are checked against Kubernetes' own JSON schemas
(kubernetes-validate, strict: no field Kubernetes lacks); the JobSet's own fields against those of
the jobset.x-k8s.io/v1alpha2 API; the pods' scripts with `bash -n`. No Kubernetes runs here: the
pods' agent command and resume logic are the ones the Slurm and per-host tests run for real."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from hethub.cli import main
from hethub.launchers.jobset import device_plugins
from hethub.spec.plan import parse_plan
from tests.test_launch import real

KUBERNETES = "1.30"
"""The Kubernetes release whose schemas the manifest is checked against (JobSet needs 1.27+)."""
# The fields of the JobSet API (jobset.x-k8s.io/v1alpha2: JobSetSpec, ReplicatedJob, Network,
# FailurePolicy), for the part no Kubernetes schema covers.
JOBSET_SPEC = {
    "replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
    "coordinator", "managedBy", "ttlSecondsAfterFinished",
}  # fmt: skip
REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}
NETWORK = {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
FAILURE_POLICY = {"maxRestarts", "restartStrategy", "rules"}

# One NVIDIA node and two AMD nodes of 2 devices; the AMD group's name is no Kubernetes name
CLUSTER = """groups:
  - name: nv
    accelerator: h100
    nodes: 1
    devices_per_node: 2
    kubernetes:
      image: registry.example/hethub:cuda
      node_selector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3, pool: "1"}
  - name: AMD_mi300x
    accelerator: mi300x
    nodes: 2
    devices_per_node: 2
"""
PLAN = """model: tiny-llama
global_batch: 8
micro_batch: 1
pipelines:
  - count: 1
    micro_batches: 8
    stages:
      - {group: nv, tp: 2, layers: 2}
      - {group: AMD_mi300x, tp: 2, layers: 3}
      - {group: AMD_mi300x, tp: 1, layers: 3}
"""


def launch(folder: Path, *flags: str, cluster: str = CLUSTER, plan: str | None = PLAN) -> int:
    (folder / "cluster.yaml").write_text(cluster)
    files = ["--cluster", str(folder / "cluster.yaml"), *real(folder)]  # the data, the steps
    if plan is not None:
        (folder / "plan.yaml").write_text(plan)
        files += ["--plan", str(folder / "plan.yaml")]
    return main(["launch", "jobset", *files, "--out", str(folder / "out"), *flags])


def manifest(folder: Path) -> tuple[dict, dict]:
    config_map, jobset = yaml.safe_load_all((folder / "out" / "jobset.yaml").read_text())
    return config_map, jobset


FLAGS = ("--run-dir", "/runs/llama", "--volume-claim", "llm", "--image", "registry.example/rocm")


def test_the_jobset_has_a_replicated_job_per_group_that_kubernetes_schemas_accept(tmp_path):
    assert launch(tmp_path, *FLAGS, "--steps", "100", "--port", "29400") == 0
    config_map, jobset = manifest(tmp_path)
    kubernetes_validate.validate(config_map, KUBERNETES, strict=True)
    assert set(config_map["data"]) == {"cluster.yaml", "plan.yaml"}
    assert config_map["data"]["cluster.yaml"] == CLUSTER  # as the user wrote it
    carried = parse_plan(yaml.safe_load(config_map["data"]["plan.yaml"]))
    assert carried == parse_plan(yaml.safe_load(PLAN))  # the plan as parsed, defaults written out

    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    name = jobset["metadata"]["name"]
    assert name == "hethub-llama" and config_map["metadata"]["name"] == f"{name}-files"
    spec = jobset["spec"]
    assert set(spec) <= JOBSET_SPEC and set(spec["network"]) <= NETWORK
    assert (
        set(spec["failurePolicy"]) <= FAILURE_POLICY and spec["failurePolicy"]["maxRestarts"] == 3
    )
    assert spec["network"]["enableDNSHostnames"] is True
    replicated = spec["replicatedJobs"]
    assert [r["name"] for r in replicated] == ["nv", "amd-mi300x"]
    for r, nodes, image, resource in zip(
        replicated,
        (1, 2),
        ("registry.example/hethub:cuda", "registry.example/rocm"),
        (device_plugins()["nvidia"], device_plugins()["amd"]),
    ):
        assert set(r) <= REPLICATED_JOB and r["replicas"] == 1
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-x-0"}}
        kubernetes_validate.validate({**job, "spec": r["template"]["spec"]}, KUBERNETES, True)
        spec = r["template"]["spec"]
        assert (spec["parallelism"], spec["completions"]) == (nodes, nodes)
        assert spec["completionMode"] == "Indexed" and spec["backoffLimit"] == 0
        pod = spec["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 120  # --signal-seconds' default
        (container,) = pod["containers"]
        assert container["image"] == image
        assert container["resources"] == {"limits": {resource: 2}}
        env = {e["name"]: e.get("value") for e in container["env"]}
        # the agents meet at the first group's pod 0, by the host name JobSet gives it
        assert env["RDZV_ENDPOINT"] == f"{name}-nv-0-0.{name}:29400"
        claim = {v["name"]: v for v in pod["volumes"]}["run"]["persistentVolumeClaim"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert claim == {"claimName": "llm"}
        assert (mounts["run"]["mountPath"], mounts["run"]["subPath"]) == ("/runs/llama", "llama")
    nv_pod = replicated[0]["template"]["spec"]["template"]["spec"]
    assert nv_pod["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "pool": "1",
    }
    assert "nodeSelector" not in replicated[1]["template"]["spec"]["template"]["spec"]


def container_script(jobset: dict, index: int) -> str:
    pod = jobset["spec"]["replicatedJobs"][index]["template"]["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[:2] == ["bash", "-c"]
    return command[2]


def test_each_pod_runs_the_agent_of_its_node_from_its_completion_index(tmp_path):
    assert launch(tmp_path, *FLAGS) == 0
    _, jobset = manifest(tmp_path)
    nv, amd = container_script(jobset, 0), container_script(jobset, 1)
    for script in (nv, amd):
        checked = subprocess.run(
            ["bash", "-n"], input=script, text=True, capture_output=True, check=False
        )
        assert checked.returncode == 0, checked.stderr
        assert "-m hethub.launchers.node_agent --nnodes=3" in script
        assert '--rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID"' in script
        # the files from the ConfigMap, a new run or the run folder's own resumed
        assert "--cluster /etc/hethub/cluster.yaml --plan /etc/hethub/plan.yaml" in script
        assert 'START=(--resume "$RUN_DIR")' in script and "RUN_DIR=/runs/llama" in script
    assert "--nproc-per-node=2 " in nv and '--this-node=nv:"$JOB_COMPLETION_INDEX"' in nv
    # AMD's two nodes run 2 and 1 processes: each pod reads its own count
    assert "processes=(2 1)" in amd
    assert '--nproc-per-node="${processes[$JOB_COMPLETION_INDEX]}"' in amd
    assert '--this-node=AMD_mi300x:"$JOB_COMPLETION_INDEX"' in amd


def test_each_pod_starts_its_groups_python_with_its_vendors_environment(tmp_path):
    """The container's device plugin picks the devices: the pod keeps what it set, else every
    device of the node; what only the site knows is a comment in the pod's script."""
    cluster = CLUSTER.replace(
        "    devices_per_node: 2\n    kubernetes:",
        "    devices_per_node: 2\n    launch: {python: /venv/cuda/bin/python}\n    kubernetes:",
    ).replace(
        "  - name: AMD_mi300x\n", "  - name: AMD_mi300x\n    launch: {env: {NCCL_DEBUG: TRACE}}\n"
    )
    assert launch(tmp_path, *FLAGS, cluster=cluster) == 0
    _, jobset = manifest(tmp_path)
    nv, amd = container_script(jobset, 0), container_script(jobset, 1)
    assert 'export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0,1}"; ' in nv
    assert "exec /venv/cuda/bin/python -m hethub.launchers.node_agent " in nv
    assert "export NCCL_DEBUG=TRACE; " in amd and "exec python3 -m hethub" in amd
    assert "\n# export GLOO_SOCKET_IFNAME=...  # the network interface between" in amd


def test_a_model_that_is_no_preset_travels_in_the_configmap(tmp_path):
    """The plan the launch makes, for a model file: plan.yaml names model.yaml beside it."""
    (tmp_path / "small.yaml").write_text(
        "name: small\narch: llama\nlayers: 4\nhidden: 64\nheads: 4\nffn_hidden: 128\n"
        "vocab: 256\nseq_len: 32\n"
    )
    flags = ("--model", str(tmp_path / "small.yaml"), "--global-batch", "8", *FLAGS)
    cluster = CLUSTER.replace("h100", "cpu").replace("mi300x", "cpu")
    assert launch(tmp_path, *flags, cluster=cluster, plan=None) == 0
    config_map, _ = manifest(tmp_path)
    assert set(config_map["data"]) == {"cluster.yaml", "plan.yaml", "model.yaml"}
    assert yaml.safe_load(config_map["data"]["plan.yaml"])["model"] == "model.yaml"
    assert yaml.safe_load(config_map["data"]["model.yaml"])["layers"] == 4
    assert (tmp_path / "out" / "plan.yaml").is_file()  # as the other forms write it


@pytest.mark.parametrize(
    ("flags", "cluster", "said"),
    [
        (("--run-dir", "/runs/x"), CLUSTER, "jobset: --volume-claim is needed"),
        (
            ("--run-dir", "runs/x", "--volume-claim", "c"),
            CLUSTER,
            "jobset: --run-dir = 'runs/x': give the absolute path",
        ),
        (
            ("--run-dir", "/runs/x", "--volume-claim", "c"),
            CLUSTER,
            "group AMD_mi300x: no container image: give 'image' in its kubernetes: section",
        ),
        (
            FLAGS,
            CLUSTER.replace(
                "accelerator: mi300x",
                "accelerator: {name: x1, vendor: other, bf16_tflops: 100, memory_gb: 64}",
            ),
            "group AMD_mi300x: no Kubernetes resource for vendor other's devices",
        ),
        (
            FLAGS,
            CLUSTER.replace("name: nv", "name: amd-MI300X").replace(
                "group: nv", "group: amd-MI300X"
            ),
            "group AMD_mi300x: its Kubernetes name 'amd-mi300x' is empty or another group's",
        ),
        (
            ("--run-dir", "/runs/" + "r" * 48, "--volume-claim", "c", "--image", "i"),
            CLUSTER,
            "over Kubernetes' 63: give the run folder or the group a shorter name",
        ),
        (FLAGS, CLUSTER.replace("node_selector: {", "node_selectors: {"), "node_selectors"),
        (FLAGS, CLUSTER.replace('pool: "1"', "pool: 1"), "must be a mapping of node label"),
    ],
)
def test_what_cannot_be_a_jobset_is_one_line_and_exit_2(tmp_path, capsys, flags, cluster, said):
    plan = PLAN.replace("group: nv", "group: amd-MI300X") if "amd-MI300X" in cluster else PLAN
    assert launch(tmp_path, *flags, cluster=cluster, plan=plan) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # nothing written
