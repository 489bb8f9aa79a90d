"""Speculative decoding: proposers that draft tokens for the engine to verify (runtime/engine/speculation.py)."""

from appliance.runtime.speculative.base import Proposer, SpecState

__all__ = ["Proposer", "SpecState"]
