"""leyline eval mechanism (being built)."""
