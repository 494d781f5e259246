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

TEMPLATE, CONVERSATION, NONE = "template", "conversation", "none"
_MARK = "\u2063LEYLINE-ANCHOR\u2063"  # invisible separator: no template writes it itself

# Small talk for the conversation anchor: written for it, sharing nothing with the eval's
# contexts (contexts.py), so that an anchored skill is not tuned to the prefixes it meets.
_SYSTEM = "You are a friendly assistant who answers in plain words."
_EXCHANGES = (
    (
        "What is a good way to keep basil growing on a windowsill?",
        "Give it at least six hours of sun, water when the top of the soil is dry, and "
        "pinch off the flower buds so the leaves keep coming.",
    ),
    (
        "How long should I boil an egg for a soft yolk?",
        "About six minutes from when the water is back at a boil, then cool it in cold "
        "water for a minute.",
    ),
)


def _before_mark(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """What ``tokenizer``'s chat template renders before the last message's content (the
    marker), or ValueError when it does not render that content verbatim."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    head, found, _ = str(text).partition(_MARK)
    if not found:
        raise ValueError("the chat template does not render the user's content verbatim")
    return head


def template_anchor(tokenizer: Any) -> str:
    """What ``tokenizer``'s chat template renders before a user message's content.

    Raises:
        ValueError: the template renders no marker (it rewrites the content).
    """
    return _before_mark(tokenizer, [{"role": "user", "content": _MARK}])


def conversation_anchor(tokenizer: Any) -> str:
    """What the chat template renders before a user message that follows a system prompt
    and two exchanges of small talk (``_EXCHANGES``): a skill composed into a conversation
    lands mid-conversation, after more than a template's header.

    Raises:
        ValueError: the template renders no marker (it rewrites the content).
    """
    messages = [{"role": "system", "content": _SYSTEM}]
    for question, answer in _EXCHANGES:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return _before_mark(tokenizer, [*messages, {"role": "user", "content": _MARK}])


def anchor_text(spec: str | None, tokenizer: Any) -> str:
    """``--anchor``: ``none`` (or None) for no anchored arm, ``template`` for the chat
    template's header, ``conversation`` for a system prompt and two exchanges of small
    talk before a user message, anything else used as the anchor text itself."""
    if spec is None or spec == NONE:
        return ""
    if spec == CONVERSATION:
        return conversation_anchor(tokenizer)
    return template_anchor(tokenizer) if spec == TEMPLATE else spec
