"""The profiler: measured per-layer costs and link speeds of this machine, which the predictor and
the planner price plans with instead of the analytic model where they match.

This package's top level is pure Python (store and lookup); the measuring half imports torch:
``from hethub.profile.measure import ensure_profiles, measure_layers, measure_links``.
"""

from hethub.profile.store import (
    LayerKey,
    LayerProfile,
    LinkProfile,
    Profiles,
    empty_profiles,
    load_profiles,
    read_profile,
    save_profile,
    select_for_run,
)

__all__ = [
    "LayerKey",
    "LayerProfile",
    "LinkProfile",
    "Profiles",
    "empty_profiles",
    "load_profiles",
    "read_profile",
    "save_profile",
    "select_for_run",
]
