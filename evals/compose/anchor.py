"""The anchor of the ``anchored_k{K}`` arm: context tokens a skill is compiled after.

A skill compiled alone is the start of its own sequence: its first token draws the
attention-sink weight every later token gives a sequence's first position, and the rest of
the block is computed around that. Composed into a conversation, the block sits after a
real start. Compiling it after an *anchor* (``compile_skill(..., anchor=...)``, whose KV is
then dropped) gives the block a start like the one it will land in.

The default anchor is generic, not the eval's own context: the text the model's chat
template puts before a user message's content (for SmolLM2: its default system prompt and
the user header), found by rendering a one-message chat around a marker.
"""

from __future__ import annotations

from typing import Any

TEMPLATE, NONE = "template", "none"
_MARK = "\u2063LEYLINE-ANCHOR\u2063"  # invisible separator: no template writes it itself


def template_anchor(tokenizer: Any) -> str:
    """What ``tokenizer``'s chat template renders before a user message's content.

    Raises:
        ValueError: the template renders no marker (it rewrites the content).
    """
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=False
    )
    head, found, _ = str(text).partition(_MARK)
    if not found:
        raise ValueError("the chat template does not render the user's content verbatim")
    return head


def anchor_text(spec: str | None, tokenizer: Any) -> str:
    """``--anchor``: ``none`` (or None) for no anchored arm, ``template`` for the chat
    template's header, anything else used as the anchor text itself."""
    if spec is None or spec == NONE:
        return ""
    return template_anchor(tokenizer) if spec == TEMPLATE else spec
