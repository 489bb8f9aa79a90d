"""Structured output: grammars compiled by llguidance into per-step token masks. (Being written: issue 11.)"""

from __future__ import annotations

from typing import Any

import numpy as np


class GrammarError(ValueError):
    """The request's schema, regex or grammar cannot be compiled (HTTP 400 naming the problem)."""


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def consume(self, token_id: int) -> None:
        raise NotImplementedError


def apply_grammar_masks(x: np.ndarray, logits: np.ndarray, seqs: list[Any]) -> None:
    raise NotImplementedError
