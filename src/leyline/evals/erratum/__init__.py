"""``leyline eval erratum``: field-only KV refresh vs ERRATUM vs recompute on decision prompts
("Models Take Notes at Prefill"); see docs/evals-erratum.md."""
