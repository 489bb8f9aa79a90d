"""Draft-model speculative decoding: a second, small exported model with the same tokenizer drafts tokens.

The draft runs beside the target in the same engine thread, on its own OpenVINOPagedBackend (config.draft_device or
config.device) and its own BlockPool: each speculating sequence keeps a draft KV table (seq.spec.data, a _Table) of
the tokens the draft has seen. A proposal first feeds what the draft has not seen yet (the prompt at the first one,
in chunks of max_tokens_per_step; then the 1-2 tokens the target added in its last step), then runs greedy steps:
one backend.forward per step with every proposing sequence in it, each sequence's argmax fed back as its next input,
until it has its k tokens (the k-th is never fed: the target verifies it, and the next catch-up feeds it if it is
kept). The chain is the draft's deterministic argmax, which is what keeps the target's distribution exact (base.py).
After the verification, `accepted` keeps the draft KV of the longest prefix that still equals seq.token_ids and
frees the blocks past it (no copies: the positions are simply overwritten by the next feed).

KV budget: the draft pool holds as many tokens as the target's pool (the engine passes its size), so the draft
never limits which sequences can speculate; it costs what the target's pool costs times the draft's KV per token
over the target's (1x for a quantized copy of the target, less for a smaller draft; mapped only as blocks are first
used). A full pool is no error: that sequence gets no proposal this step.

Cost, SmolLM2-135M-Instruct with an fp16 target, batch 1 at a 256-token context, medians of interleaved runs on the
2-core AVX2 box under load (bench/draft_acceptance.py): a draft step of the int8 copy costs 0.54-0.67 of a target
step, a propose of k=5 about 3 (Python is not the cost: the same propose on a 6-layer int4 copy is 0.32); at this
size a step is bound by per-call overhead more than by the bytes of weights. That copy drafts 94% / 88% of the
target's greedy tokens (grounded / chat prompts); truncated copies (python -m export --num-layers N) are cheaper but
draft 1-15% (layers are not trained to exit early). So the default model's draft is its int8 export; with an f32
target (EngineConfig(precision="f32")) it decodes 1.2-2.1x faster, with the default fp16 one 0.85-1.36x.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from appliance.config import EngineConfig
from appliance.manifest import Manifest
from appliance.runtime.backends.base import StepBatch
from appliance.runtime.backends.openvino_paged import OpenVINOPagedBackend
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.speculative.base import Proposer

if TYPE_CHECKING:
    from appliance.runtime.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Table:
    """One sequence's draft KV: `tokens` are the positions it holds, in `blocks`."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def _vocabulary(path: Path) -> tuple[object, ...]:
    """What decides token ids in a tokenizer.json: the model (vocab, merges) and the added tokens."""
    data = json.loads(path.read_text())
    model = data.get("model") or {}
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges") or []]
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
    return model.get("type"), model.get("vocab"), merges, added


def check_same_tokenizer(draft_dir: Path, draft: Manifest, target_dir: Path, target: Manifest) -> None:
    """ValueError unless the draft's token ids mean what the target's do."""
    a, b = draft_dir / draft.tokenizer_file, target_dir / target.tokenizer_file
    if a.read_bytes() != b.read_bytes() and _vocabulary(a) != _vocabulary(b):
        raise ValueError(
            f"draft model {draft_dir}: its tokenizer differs from the model's ({target_dir}); a draft "
            "model must use the same tokenizer"
        )
    if draft.vocab_size > target.vocab_size:
        raise ValueError(
            f"draft model {draft_dir}: its vocabulary ({draft.vocab_size}) is larger than the model's "
            f"({target.vocab_size})"
        )


class DraftModel(Proposer):
    """Loads `model_dir` (an export, same tokenizer as the target: refused otherwise) on config.draft_device (or
    config.device) with its own paged KV pool, and keeps one draft KV table per speculating sequence."""

    name = "draft"
    adaptive = True  # every drafted token is a draft-model step

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig,
        target_dir: Path,
        max_tokens_per_step: int,
        kv_tokens: int,
    ):
        self.model_dir = Path(model_dir)
        manifest = Manifest.load(self.model_dir)
        target = Manifest.load(target_dir)
        check_same_tokenizer(self.model_dir, manifest, Path(target_dir), target)
        if manifest.backend != "openvino":
            raise ValueError(
                f"draft model {model_dir}: a draft must be an OpenVINO export (paged attention), not {manifest.backend}"
            )
        self.config = dataclasses.replace(
            config,
            device=config.draft_device or config.device,
            static=False,
            kv_cache_bytes=None,
            kv_cache_tokens=kv_tokens,
            draft_model=None,
        )
        self.backend = OpenVINOPagedBackend(self.model_dir, manifest, self.config)
        self.pool = BlockPool(self.backend.num_blocks, self.backend.block_size)
        self.max_tokens = max(1, max_tokens_per_step)
        self.forwards = 0  # draft forward calls (stats)

    def start(self, seq: Sequence) -> None:
        assert seq.spec is not None
        seq.spec.data = _Table()

    def _table(self, seq: Sequence) -> _Table:
        assert seq.spec is not None
        if not isinstance(seq.spec.data, _Table):
            seq.spec.data = _Table()
        return seq.spec.data

    def _keep(self, table: _Table, n: int) -> None:
        """Keep the first n positions of the table, free the blocks past them."""
        del table.tokens[n:]
        keep = self.pool.blocks_for(n)
        if len(table.blocks) > keep:
            self.pool.free(table.blocks[keep:])
            del table.blocks[keep:]

    def _sync(self, seq: Sequence) -> _Table:
        """Drop the draft positions past the longest prefix that still equals seq.token_ids."""
        table, ids = self._table(seq), seq.token_ids
        n = min(len(table.tokens), len(ids))
        if table.tokens[:n] != ids[:n]:
            n = next(i for i, (a, b) in enumerate(zip(table.tokens, ids)) if a != b)
        self._keep(table, min(n, len(ids) - 1))  # at least the last token is fed: its logits give d1
        return table

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in batch]
        want: dict[int, int] = {}  # batch index -> tokens wanted
        pending: dict[int, list[int]] = {}  # batch index -> tokens to feed before the next argmax
        for i, (seq, k) in enumerate(batch):
            table = self._sync(seq)
            k = min(k, self.backend.max_context - len(seq.token_ids))
            if k > 0:
                want[i], pending[i] = k, seq.token_ids[len(table.tokens) :]
        while want:
            fed: list[tuple[int, list[int]]] = []
            budget = self.max_tokens - len(want)  # every sequence feeds at least one token
            for i in list(want):
                ids = pending[i]
                n = min(len(ids), 1 + max(0, budget))
                budget -= n - 1
                if not self._grow(self._table(batch[i][0]), n):
                    del want[i]  # the draft pool is full: what it has so far is the proposal
                    continue
                fed.append((i, ids[:n]))
            if not fed:
                break
            tables = [self._table(batch[i][0]) for i, _ in fed]
            logits = self._forward([ids for _, ids in fed], tables)
            for row, ((i, ids), table) in enumerate(zip(fed, tables)):
                table.tokens += ids
                pending[i] = pending[i][len(ids) :]
                if pending[i]:
                    continue  # a prompt chunk: its logits are not the next token's yet
                token = self._pick(logits[row], batch[i][0])
                if token is not None:
                    out[i].append(token)
                if token is None or len(out[i]) == want[i]:
                    del want[i]
                else:
                    pending[i] = [token]
        return out

    def _grow(self, table: _Table, n: int) -> bool:
        """Blocks for n more positions; False (nothing taken) when the pool cannot give them."""
        need = self.pool.blocks_for(len(table.tokens) + n) - len(table.blocks)
        if need > 0:
            if not self.pool.can_allocate(need):
                return False
            table.blocks += self.pool.allocate(need)
        return True

    def _forward(self, ids: list[list[int]], tables: list[_Table]) -> np.ndarray:
        self.forwards += 1
        return self.backend.forward(StepBatch(ids, [len(t.tokens) for t in tables], [t.blocks for t in tables]))

    @staticmethod
    def _pick(row: np.ndarray, seq: Sequence) -> int | None:
        """The draft's argmax; None when its probability is below the sequence's confidence threshold."""
        token = int(row.argmax())
        threshold = seq.spec.confidence if seq.spec is not None else None
        if threshold is not None and 1.0 / float(np.exp(row - row[token]).sum()) < threshold:
            return None
        return token

    def accepted(self, seq: Sequence) -> None:
        self._sync(seq)

    def release(self, seq: Sequence) -> None:
        if seq.spec is not None and isinstance(seq.spec.data, _Table):
            self._keep(seq.spec.data, 0)

    def stats(self) -> dict[str, int]:
        return {
            "draft_kv_blocks_used": self.pool.num_used,
            "draft_kv_blocks_total": self.pool.num_blocks,
            "draft_forwards": self.forwards,
        }

    def close(self) -> None:
        self.backend.close()
