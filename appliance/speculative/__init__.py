"""Speculative decoding: proposers that draft tokens for the engine to verify (appliance/engine/speculation.py)."""

from appliance.speculative.base import Proposer, SpecState

__all__ = ["Proposer", "SpecState"]
