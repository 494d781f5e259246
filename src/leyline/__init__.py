"""Leyline: KV-cache directives (splice, forget, erratum, compose) for agentic inference.

The layers, outermost first: ``policies`` (agent side, no torch) emits ``protocol``
directives; ``core`` plans them for any backend; ``engine`` (the reference torch engine,
``serve``-d over HTTP) and ``sglang`` execute them; ``evals`` measures both sides.
"""
