"""The profile store: measured per-layer costs and link speeds of a machine, which the predictor
and the planner price plans with instead of the analytic model where they match. Pure Python
(read, write, look up); the measuring is hethub.profiler's, with torch."""

from hethub.profiles.files import load_profiles, read_profile, save_profile
from hethub.profiles.selection import Profiles, empty_profiles, select_for_run
from hethub.profiles.types import LayerKey, LayerProfile, LinkProfile

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
