"""Banned token sequences: Friendli's bad_words / bad_word_tokens and no_repeat_ngram. (Being written: issue 11.)"""

from __future__ import annotations

from typing import Any

import numpy as np


class Bans:
    """One sequence's banned continuations."""

    @classmethod
    def build(cls, params: Any, prompt_ids: list[int], tokenizer: Any) -> Bans | None:
        """None when the request bans nothing (the common case: no per-step cost)."""
        return None

    def banned(self, sampler: Any) -> np.ndarray:
        """int64 token ids that must not be sampled next."""
        raise NotImplementedError
