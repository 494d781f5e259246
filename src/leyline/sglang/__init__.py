"""The SGLang plugin: Leyline directives executed on SGLang's own radix cache and KV pools.

Follow one splice: the session core's routes and service (``leyline.core``:
sessions, revisions, the protocol's resolve + algebra, in SGLang's server process) ->
``backend.SglangBackend`` (executes the checked plan) -> ``tokenizer_side`` (a control
request over SGLang's zmq channel) -> ``scheduler_side`` (in the scheduler process) ->
``executor.SpliceExecutor`` (match, copy + rotate, insert) -> ``kv_rows`` / ``tree_ops``.

``plugin.register`` is the ``sglang.srt.plugins`` entry point. Only the modules that need
SGLang import it, lazily: ``import leyline.sglang`` never does.
"""
