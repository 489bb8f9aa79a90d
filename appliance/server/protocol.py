"""What HTTP workers and the engine process say to each other over the Unix socket.

Transport: `multiprocessing.connection` (length-prefixed pickle, HMAC challenge with a random authkey that only
this server's processes can read). A worker keeps a small pool of connections; on each it either makes a call
(one request, one reply) or runs one job (a generation request) whose events stream back until `End`.
Closing a connection in the middle of a job cancels the job's sequences: that is how a client disconnect
frees its KV at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from appliance.outputs import Chunk, Timing
from appliance.params import SamplingParams


# ---- calls: (name, *args) -> Reply
STATUS = "status"        # () -> EngineStatus
METRICS = "metrics"      # () -> str (Prometheus text)
TOKENIZE = "tokenize"    # (list[str]) -> list[list[int]]
RECORD_HTTP = "http"     # (HttpRecord) -> Reply()
JOB = "job"              # (Job) -> events: Accepted | Failed, then ChoiceChunk..., then End


@dataclass
class Reply:
    value: object = None
    error: "Failed | None" = None


@dataclass
class EngineStatus:
    state: str                                  # loading | ready | failed | stopping
    error: str | None = None
    max_context: int = 0
    vocab_size: int = 0
    generation_defaults: dict = field(default_factory=dict)
    backend: str = ""
    weight_format: str = ""
    device: str = ""

    @property
    def ready(self) -> bool:
        return self.state == "ready"


@dataclass
class PromptSpec:
    """One prompt as the client gave it; the engine process tokenizes (one tokenizer, next to the model)."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None          # chat: rendered with the model's chat template


@dataclass
class Job:
    request_id: str
    prompts: list[PromptSpec]
    params: SamplingParams
    n: int = 1                                  # sequences per prompt; choice index = prompt * n + j
    echo: bool = False


@dataclass
class HttpRecord:
    route: str
    method: str
    status: int
    seconds: float
    error_type: str | None = None


# ---- job events (engine -> worker)
@dataclass
class Accepted:
    prompt_tokens: list[int]                    # per prompt
    echo_texts: list[str] | None = None         # per prompt, when echo was asked


@dataclass
class Failed:
    """An error the worker answers with as is (status + OpenAI error fields)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass
class ChoiceChunk:
    index: int
    chunk: Chunk
    timing: Timing | None = None                # with the last chunk of the choice


@dataclass
class End:
    pass
