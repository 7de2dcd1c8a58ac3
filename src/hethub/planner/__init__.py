"""The automatic parallel planner: pure Python, no torch. It asks the predictor, never the
runtime."""

from hethub.planner.bound import GroupShare, UpperBound, upper_bound
from hethub.planner.search import SearchResult, search
from hethub.planner.search_state import PricedPlan

__all__ = ["GroupShare", "PricedPlan", "SearchResult", "UpperBound", "search", "upper_bound"]
