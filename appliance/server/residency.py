"""Which models stay in memory: the policy of loading on demand and unloading when idle, as a small object with
its inputs in its signatures (the supervisor does the loads and unloads it decides; unit-tested without a server).

Two rules, Ollama's:
- keep_alive (appliance/keep_alive.py): a model idle (no request in flight) for its keep_alive is unloaded; the
  last request's keep_alive applies, else the model's default (`--keep-alive`, a config entry's `keep_alive`;
  forever by default, so a server without it behaves as before). 0 unloads it as soon as its requests end.
- a memory budget across the models (`--models-memory-budget`, none by default): loading a model that would
  exceed it unloads idle models first, least recently used first; when only models with requests in flight are
  left, the load waits (the supervisor bounds the wait, then the request gets a 503). A model with a request in
  flight is never chosen: its KV holds that request's state. A model larger than the whole budget loads only
  when nothing else is loaded (Ollama does the same rather than refuse it: the operator's budget is then too
  small for that model, which the log says).

Memory of a model (`estimate`): its export's files (the weights: an OpenVINO IR's .bin or an ONNX file, mapped and
compiled into about their own size on CPU) plus its KV pool. Before a model's first load the pool is estimated
from its EngineConfig: kv_cache_bytes as given; kv_cache_tokens x 2 (K and V) x layers x KV heads x head size x
the KV element's bytes (u8 on CPU by default, f16 elsewhere, f32 when asked); auto: the auto budget's rule
(runtime/backends/kv_budget.py: a quarter of MemAvailable, capped at max_num_seqs full contexts). After a load
the pool's real size (the backend's `cache_bytes`) replaces the estimate. An estimate, not a measure of RSS: the
compiled graph's scratch buffers and the tokenizer come on top (a few percent on the models measured), so a budget
should leave that margin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.config import EngineConfig
from appliance.host import meminfo_bytes
from appliance.keep_alive import FOREVER
from appliance.manifest import Manifest

KV_AUTO_FRACTION = 0.25  # runtime/backends/kv_budget.py's AUTO_FRACTION (the runtime is not imported here)
KV_AUTO_FLOOR = 256 << 20
DEFAULT_BLOCK = 16


@dataclass(frozen=True)
class Resident:
    """A loaded model as the policy sees it."""

    name: str
    size: int  # bytes (estimate)
    last_used: float  # monotonic seconds: when its last request ended (or it loaded)
    busy: bool  # a request in flight: never unloaded
    keep_alive: float = FOREVER  # seconds it may stay idle


@dataclass(frozen=True)
class Plan:
    """What loading a model needs first: `unload` these (idle, least recently used first); or `wait` for a busy
    model to go idle (nothing to unload now). `alone`: larger than the budget, it loads with nothing beside it."""

    unload: tuple[str, ...] = ()
    wait: bool = False
    alone: bool = False


class Residency:
    """The budget (bytes; None: no budget) and the two decisions: what to unload to load a model, which idle models
    have outlived their keep_alive."""

    def __init__(self, budget: int | None):
        self.budget = budget

    def plan(self, name: str, size: int, residents: Sequence[Resident]) -> Plan:
        """To load `name` (`size` bytes) beside `residents` (the loaded models; `name` among them is ignored)."""
        others = [r for r in residents if r.name != name]
        if self.budget is None:
            return Plan()
        used = sum(r.size for r in others)
        if used + size <= self.budget:
            return Plan()
        alone = size > self.budget
        need = used + size - self.budget if not alone else used  # alone: everything else goes
        victims: list[str] = []
        for r in sorted((r for r in others if not r.busy), key=lambda r: r.last_used):
            if need <= 0:
                break
            victims.append(r.name)
            need -= r.size
        if need > 0:  # busy models hold the rest: unload nothing yet, try again when one goes idle
            return Plan(wait=True, alone=alone)
        return Plan(tuple(victims), alone=alone)

    @staticmethod
    def expired(residents: Iterable[Resident], now: float) -> list[str]:
        """The idle models whose keep_alive has run out (oldest first)."""
        idle = [r for r in residents if not r.busy and r.keep_alive != FOREVER and now - r.last_used >= r.keep_alive]
        return [r.name for r in sorted(idle, key=lambda r: r.last_used)]

    @staticmethod
    def next_expiry(residents: Iterable[Resident], now: float) -> float | None:
        """Seconds until the first idle model's keep_alive runs out (0: one has), None when no idle model has a
        finite keep_alive (a busy one's clock starts when its last request ends, which the caller hears of)."""
        ends = [r.last_used + r.keep_alive for r in residents if not r.busy and r.keep_alive != FOREVER]
        return max(0.0, min(ends) - now) if ends else None


def kv_element_bytes(config: EngineConfig) -> int:
    precision = config.kv_cache_precision or ("u8" if config.device.upper().startswith("CPU") else "f16")
    return {"u8": 1, "f16": 2, "f32": 4}.get(precision, 2)


def estimate(model_dir: str | Path, config: EngineConfig, kv_bytes: int | None = None) -> int:
    """A model's bytes in memory: its export's files + its KV pool (`kv_bytes` when measured after a load; else
    from `config`, as the module docstring says)."""
    directory = Path(model_dir)
    try:
        weights = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    except OSError:
        weights = 0
    if kv_bytes is not None:
        return weights + kv_bytes
    if config.kv_cache_bytes is not None:
        return weights + config.kv_cache_bytes
    try:
        m = Manifest.load(directory)
    except (OSError, ValueError, TypeError):
        return weights
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * kv_element_bytes(config)
    if config.static or m.backend == "onnx":  # slots: static_batch x static_context positions
        return weights + per_token * (config.static_batch or 1) * (config.static_context or m.max_context)
    if config.kv_cache_tokens is not None:
        return weights + per_token * config.kv_cache_tokens
    ceiling = config.max_num_seqs * -(-m.max_context // DEFAULT_BLOCK) * DEFAULT_BLOCK * per_token
    available = meminfo_bytes("MemAvailable")
    floor = min(KV_AUTO_FLOOR, ceiling)
    auto = floor if available is None else max(floor, min(ceiling, int(KV_AUTO_FRACTION * available)))
    return weights + auto
