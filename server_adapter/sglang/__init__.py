"""SGLang plugin (being built)."""
