"""Teacher-forced scoring (KLD, perplexity): log-probs at every position of given texts, through the engine's cache.

Without eviction, or with a budget that covers a whole text, each text is one prefill.

Under eviction a text is scored as a generation would see it: its first ``prompt_len`` tokens are the prompt,
prefilled and then evicted down to the budget (the policy's share of the prompt); every later token is one
decode step, fed the text's next token in place of a sampled one, and the cache is evicted again whenever it
holds budget + one block. A scored position thus sees exactly the cache that generation would hold there, and
its logits are that decode step's own. A whole-text prefill would let every position attend to the whole
context, so eviction would change nothing that is scored.
"""

from __future__ import annotations

import torch

from qbench.kernels import build as kernels
from qbench.kernels import ops
from qbench.engine.footprint import Footprint, footprint
from qbench.engine.sampling import SamplingParams
from qbench.engine.sequence import Sequence, make_sequences
from qbench.errors import QBenchError


def score(engine, token_lists: list[list[int]], prompt_len: int | None = None) -> list[torch.Tensor]:
    """-> log_softmax logits, float32, of each list: (T_i, V) at every position, or with ``prompt_len`` only from the
    prompt's last position on, (T_i - prompt_len + 1, V): row r is position prompt_len - 1 + r. The prompt's other
    rows predict nothing a caller with a prompt scores, and at a 4k window of a 152k vocabulary they would take
    GBs. Under eviction ``prompt_len`` also says where decode begins (above)."""
    seqs = make_sequences(token_lists, SamplingParams(max_new_tokens=1), engine.config.max_positions)
    ev = engine.eviction
    if prompt_len is not None and not all(1 <= prompt_len < len(s) for s in seqs):
        raise QBenchError(f"engine: a prompt of {prompt_len} tokens must leave at least one token of each text "
                          f"(the shortest has {min(len(s) for s in seqs)}) to score")
    start = 0 if prompt_len is None else prompt_len - 1
    if ev is None:
        return _prefilled(engine, seqs, start)
    if prompt_len is None:
        if all(len(s) <= ev.tokens(len(s)) for s in seqs):
            return _prefilled(engine, seqs, start)
        raise QBenchError(f"engine: teacher-forced scoring with KV eviction ({ev.describe()}) needs the prompt's "
                          f"length: only the tokens after it are scored as decode steps over the evicted cache; "
                          f"this task does not give one, so run it without kv.evict")
    if all(len(s) <= ev.tokens(prompt_len) for s in seqs):
        return _prefilled(engine, seqs, start)
    return _decoded(engine, token_lists, prompt_len)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) logits -> float32 log-probs, the same bits on every CPU: torch's own sums each row's exponentials
    in an order that follows the vector width (AVX2 or AVX-512) and takes them from MKL, whose code path follows
    the CPU too, so a scored figure moved in its last digits between machines. The native kernel has one order
    (``qb_log_softmax``); without it, the exponentials are summed in float64, where an order rarely shows."""
    x = logits.float()
    if kernels.available():
        return ops.log_softmax(x)
    m = x.amax(-1, keepdim=True)
    shifted = x - m
    lse = shifted.exp().sum(-1, keepdim=True, dtype=torch.float64).log().float()
    return shifted.sub_(lse)


def _prefilled(engine, seqs: list[Sequence], start: int) -> list[torch.Tensor]:
    engine._size_pool([footprint(len(s), len(s), engine.block_size) for s in seqs])
    out = []
    for i in range(0, len(seqs), engine.max_batch):
        wave = seqs[i: i + engine.max_batch]
        for j, s in enumerate(wave):
            s.kv_slot = j
            _room(engine, len(s))
            engine.blocks.reserve(s, len(s))
        logits = engine.runner.prefill(wave, all_logits=True)  # (B, T, V)
        for j, s in enumerate(wave):
            out.append(log_softmax(logits[j, start: len(s)]))
            engine.blocks.release(s)
    return out


def _decoded(engine, token_lists: list[list[int]], prompt_len: int) -> list[torch.Tensor]:
    texts = [list(t) for t in token_lists]
    params = [SamplingParams(max_new_tokens=len(t) - prompt_len, ignore_eos=True) for t in texts]
    seqs = make_sequences([t[:prompt_len] for t in texts], params, engine.config.max_positions)
    # a wave prefills its prompts together (each its peak at once), then holds at most its budget plus one block
    fps = [footprint(prompt_len, len(t), engine.block_size, engine.eviction) for t in texts]
    engine._size_pool([Footprint(f.peak, f.peak, f.evicts) for f in fps])
    ev, blocks = engine.evictor, engine.blocks
    out: list[torch.Tensor] = []
    for i in range(0, len(seqs), engine.max_batch):
        wave, full = seqs[i: i + engine.max_batch], texts[i: i + engine.max_batch]
        for j, s in enumerate(wave):
            s.kv_slot = j
            _room(engine, prompt_len)
            blocks.reserve(s, prompt_len)
        last = engine.runner.prefill(wave)  # (B, V): the prompt's last position, before any eviction
        rows = [[log_softmax(last[j: j + 1])] for j in range(len(wave))]
        for s in wave:
            s.prefilled = True
            ev.after_prefill(s)
        while True:
            live = [j for j, s in enumerate(wave) if len(s) < len(full[j])]
            if not live:
                break
            for j in live:
                s = wave[j]
                s.output_ids.append(full[j][len(s)])  # the text's token, where generation would sample
                blocks.prepare_write(s, len(s))
            step = engine.runner.decode([wave[j] for j in live])  # (b, V)
            for r, j in enumerate(live):
                rows[j].append(log_softmax(step[r: r + 1]))
                ev.after_decode(wave[j])
        for j, s in enumerate(wave):
            out.append(torch.cat(rows[j]))
            blocks.release(s)
            ev.forget(s)
    return out


def _room(engine, tokens: int) -> None:
    if engine.cache is not None:  # a no-op with room
        engine.cache.evict(engine.blocks.blocks_for(tokens) - engine.blocks.num_free)
