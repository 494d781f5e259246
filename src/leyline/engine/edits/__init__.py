"""Edits on a session's KV: splice runs, re-prefill, COMPOSE of skills and its recompute."""
