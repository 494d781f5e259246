"""What a loader hands to the engine: a model, its tokenizer, and where they came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A causal LM ready for the engine (eval mode, no grad needed).

    ``random_weights`` marks test models (the tiny MLA builders): anything that reports
    figures from such a model must say so, and :attr:`label` does.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    source: str
    random_weights: bool = False

    @property
    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if not self.random_weights:
            return f"{self.name} ({dtype})"
        # fp32 is the test models' default: name any other dtype beside the warning.
        return f"{self.name} (RANDOM WEIGHTS{'' if dtype == 'float32' else ', ' + dtype})"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a generation: the config's EOS ids plus the tokenizer's."""
        ids: list[int] = []
        eos = self.model.generation_config.eos_token_id
        ids.extend(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        return tuple(dict.fromkeys(ids))
