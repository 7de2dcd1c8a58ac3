"""The runtime: processes that train exactly what a plan says (reads plans, never the planner)."""
