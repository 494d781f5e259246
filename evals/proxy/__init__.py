"""leyline eval proxy (being built)."""
