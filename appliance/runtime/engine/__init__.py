"""The generation loop: requests in, streamed chunks out, one engine thread driving scheduler -> backend ->
sampler -> detokenizer -> stop rules. Usable without HTTP: `Engine(model_dir).generate(prompt, params)`.

One module per concern (each says why it is built the way it is):
- core.py: Engine, the heartbeat: step() = schedule -> backend forward -> per-request postprocess;
- admission.py: submissions from any thread (prompt checks, the queue bound, the inbox), QueueFull, PromptTooLong;
- handles.py: RequestHandle, the one type a caller holds for any request;
- choices.py: n > 1 choices sharing one prompt's KV (FollowerForks, Engine.choices);
- speculation.py: speculative decoding, drafts and their verification (Speculation, Engine.speculation);
- beams.py: beam search (best_of > 1) as groups of sequences (BeamSearches, Engine.beams);
- logprobs.py: sampled and prompt logprobs; text.py: a token's text (detokenizer, stop strings);
- liveness.py: the engine thread's loop, failure isolation, heartbeat / death, fault injection.
"""

from appliance.runtime.engine.admission import PromptTooLong, QueueFull
from appliance.runtime.engine.core import Engine
from appliance.runtime.engine.handles import RequestHandle
from appliance.runtime.engine.liveness import EngineDead, InjectedFault
from appliance.runtime.sequence import STOP_WINDOW_TOKENS

__all__ = [
    "Engine",
    "RequestHandle",
    "QueueFull",
    "PromptTooLong",
    "EngineDead",
    "InjectedFault",
    "STOP_WINDOW_TOKENS",
]
