"""Speculative decoding: proposers that draft tokens for the engine to verify (runtime/engine/speculation.py).

base.py: the Proposer interface; state.py: a sequence's SpecState; ngram.py: prompt lookup; draft.py: a draft model.
Nothing is re-exported here: runtime/sequence.py imports state.py, and this package must not import base.py (which
names Sequence) on that path."""
