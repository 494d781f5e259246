"""The ``sglang.srt.plugins`` entry point: SGLang calls :func:`register` in every process.

It only registers two hooks (SGLang applies them right after): the scheduler learns to
answer Leyline control requests, and the tokenizer manager (server process) gets the
channel to send them plus the ``/leyline/v1`` routes. Set ``SGLANG_PLUGINS`` to a list
without ``leyline`` to switch the plugin off.
"""

from __future__ import annotations

from typing import Any

SCHEDULER_TARGET = "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher"
TOKENIZER_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.init_communicators"


def _after_request_dispatcher(_result: Any, scheduler: Any, *_args: Any, **_kw: Any) -> None:
    from leyline.sglang.scheduler_side import install

    install(scheduler)


def _after_communicators(_result: Any, tokenizer_manager: Any, *_args: Any, **_kw: Any) -> None:
    from leyline.sglang.tokenizer_side import install

    install(tokenizer_manager)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SCHEDULER_TARGET, _after_request_dispatcher, HookType.AFTER)
    HookRegistry.register(TOKENIZER_TARGET, _after_communicators, HookType.AFTER)
