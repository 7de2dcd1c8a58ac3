"""The automatic parallel planner: pure Python, no torch. It asks the predictor, never the
runtime."""

from hethub.planner.search import Ranked, SearchResult, search, upper_bound

__all__ = ["Ranked", "SearchResult", "search", "upper_bound"]
