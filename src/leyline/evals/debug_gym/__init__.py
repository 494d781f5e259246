"""The debug-gym policy leg: mini_nightmare solve rates with and without a context policy.

Three arms: ``none`` (the agent's history as built), ``reprefill`` (a leyline.policies
policy edits it; edited messages go out plainly) and ``splice`` (the same edits as Leyline
directives; against a server without Leyline it runs as re-prefill, and says so).

Runs inside the Python 3.12 venv that ``scripts/debug_gym/setup_env.sh`` builds:
``python -m leyline.evals.debug_gym --help``. This module and the pure ones (``config``,
``records``, ``stats``, ``summary``, ``report``, ``plot``, ``server``, ``sandbox``) do not
import debug_gym; ``tasks``, ``llm``, ``scripted``, ``agent``, ``runner`` do.
"""

from __future__ import annotations
