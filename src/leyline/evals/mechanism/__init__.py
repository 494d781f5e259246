"""``leyline eval mechanism``: replayed agent trajectories, splice vs prefix-cache re-prefill.

The paper's SGLang microbenchmark on our server: clients replay multi-turn tool-using
trajectories under a truncation policy, at several concurrencies, and each turn is sent
twice: with the policy's edits as Leyline splices, and as plain edited messages that the
server re-prefills from the first changed token (its warm prefix reused).
"""
