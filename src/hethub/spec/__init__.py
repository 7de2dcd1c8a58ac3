"""Typed, validated inputs: the accelerator catalog, cluster, model and plan files."""

from hethub.spec.accelerator import AcceleratorSpec, catalog, lookup
from hethub.spec.check import check_plan
from hethub.spec.cluster import ClusterSpec, DeviceGroup, load_cluster, parse_cluster
from hethub.spec.model import ModelSpec, load_model, parse_model, preset_names
from hethub.spec.plan import PipelineLayout, Plan, StageSpec, load_plan, parse_plan

__all__ = [
    "AcceleratorSpec",
    "ClusterSpec",
    "DeviceGroup",
    "ModelSpec",
    "PipelineLayout",
    "Plan",
    "StageSpec",
    "catalog",
    "check_plan",
    "load_cluster",
    "load_model",
    "load_plan",
    "lookup",
    "parse_cluster",
    "parse_model",
    "parse_plan",
    "preset_names",
]
