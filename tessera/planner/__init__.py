"""Planner: hardware descriptions, cost model, scaling laws; pure Python + numpy (no torch)."""
