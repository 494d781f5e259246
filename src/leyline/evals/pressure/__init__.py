"""``leyline eval pressure``: agents under a tight cache budget, whole-session eviction vs
DECAY spans (docs/evals-pressure.md)."""
