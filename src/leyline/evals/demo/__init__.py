"""``leyline demo``: one tool-using episode, its edits routed as splices and as re-prefills.

The agent's tool-call decisions are scripted (``script.py``); the tools (``tools.py``, on
the bundled ``sample_project/``), the model's generation, the policy and the cache edits
are real. ``run.py`` starts the embedded server (``server.py``) or connects to an endpoint,
``episode.py`` runs both arms turn by turn, ``report.py`` prints and writes the results.
"""
