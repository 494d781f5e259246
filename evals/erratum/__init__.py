"""leyline eval erratum (being built)."""
