"""leyline eval fidelity (being built)."""
