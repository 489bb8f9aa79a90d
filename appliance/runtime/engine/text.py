"""The text a token adds to its choice: the one rule the streaming path (Engine._append) and beam search's
whole-choice Chunks (beams.py) share, so that a beam's text is exactly what streaming would have made."""

from __future__ import annotations

from appliance.runtime.detokenizer import IncrementalDetokenizer
from appliance.runtime.stopping import StopStringMatcher


def text_step(
    detok: IncrementalDetokenizer, stop: StopStringMatcher | None, token: int, reason: str | None, include_stop: bool
) -> tuple[str, bool]:
    """The text one token adds to a choice, and whether a stop string ended it there. `reason`: why the token
    ends the choice (None: it does not). The EOS / stop token that ends a choice is not text the user asked for
    (as OpenAI and vLLM do) unless include_stop_str_in_output; the last token flushes what was held back."""
    text = "" if reason == "stop" and not include_stop else detok.add([token])
    if reason is not None:
        text += detok.flush()
    if stop is None:
        return text, False
    text, stopped = stop.feed(text)
    if not stopped and reason is not None:
        text += stop.flush()
    return text, stopped
