"""``leyline eval compose``: precomputed skills composed into sessions vs a full prefill."""
