"""``leyline eval fidelity``: how close a splice is to full context and to re-prefill.

Per-layer key error of the rotation, bf16 drift over repeated splices, next-token KL and
argmax over generated agent transcripts. Entry point ``cli.py``; see docs/evals-fidelity.md.
"""
