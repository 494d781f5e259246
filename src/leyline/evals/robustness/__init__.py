"""``leyline eval robustness``: fuzzed requests on every route, lost updates under races,
redaction leaks after FORGET, cross-tenant reuse, and /health latency under load."""
