"""A tiny compose scene shared by the compose eval's engine tests (RANDOM WEIGHTS)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leyline.engine.edits.skills import Skill, compile_skill
from leyline.engine.engine import Engine
from leyline.engine.models import build_tiny_mla
from leyline.engine.session import SessionCache


@dataclass(frozen=True, slots=True)
class Scene:
    engine: Engine
    prefix: SessionCache
    """The prefix, prefilled."""
    skill: Skill
    question: list[int]


@torch.inference_mode()
def tiny_scene(layers: int = 4, lengths: tuple[int, int, int] = (20, 30, 5)) -> Scene:
    """A tiny MLA model (``layers`` decoder layers), a prefilled random prefix, a random
    skill compiled alone and a random question, of ``lengths`` tokens."""
    engine = Engine(build_tiny_mla("v2", num_hidden_layers=layers))
    g = torch.Generator().manual_seed(0)
    prefix_ids, block, question = (
        torch.randint(0, engine.vocab_size, (n,), generator=g).tolist() for n in lengths
    )
    prefix = SessionCache(engine)
    prefix.prefill(prefix_ids)
    return Scene(engine, prefix, compile_skill(engine, block, skill_id="s", tenant="t"), question)
