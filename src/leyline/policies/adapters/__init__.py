"""Adapters that hand an agent framework a client wrapped by Leyline, one module per
framework, each an optional extra (``pip install 'leyline[agents]'``, ``'leyline[langchain]'``).

Nothing here is imported by :mod:`leyline.policies`: a module imports its framework when one
of its functions is called, so the base SDK never needs it.

* :mod:`.openai_agents`: the OpenAI Agents SDK (``leyline_agents_model``,
  ``use_leyline_by_default``); docs/frameworks/openai-agents.md;
* :mod:`.langchain`: LangChain's ``ChatOpenAI`` (``leyline_chat_openai``), for
  ``create_agent`` and any chain; docs/frameworks/langchain.md.
"""
