"""The no-KV-cache baseline: recompute the whole sequence at every step.

This is the seeds' starting point (O(N^2) work per sequence). It runs qbench's own
model on the cache-free attention path, so the only difference from the engine is
the cache itself.
"""

from __future__ import annotations

import time

import torch

from qbench.engine.engine import StepStats
from qbench.engine.sampling import SamplingParams, sample_batch
from qbench.engine.sequence import Sequence, make_sequences
from qbench.engine.stopping import check_finished
from qbench.layers.attention import AttnMetadata
from qbench.models.base import CausalLM


def dense_forward(model: CausalLM, token_lists: list[list[int]]) -> torch.Tensor:
    """Full forward of right-padded rows without a cache -> logits (B, V) at each row's last token."""
    T = max(len(t) for t in token_lists)
    ids = torch.tensor([t + [0] * (T - len(t)) for t in token_lists], dtype=torch.int64)
    valid = torch.tensor([[1] * len(t) + [0] * (T - len(t)) for t in token_lists], dtype=torch.bool)
    meta = AttnMetadata(positions=torch.arange(T).expand(len(token_lists), T), key_valid=valid)
    last = torch.tensor([len(t) - 1 for t in token_lists])
    return model(ids, meta, None, logits_index=last)


class NoCacheEngine:
    def __init__(self, model: CausalLM, detokenize=None):
        self.model = model
        self.config = model.config
        self.eos_ids = set(model.config.eos_token_ids)
        self.detokenize = detokenize
        self.stats = StepStats()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        seqs = make_sequences(prompts, params, self.config.max_positions)
        running, first = list(seqs), True
        while running:
            t0 = time.perf_counter()
            logits = dense_forward(self.model, [s.token_ids for s in running])
            dt = time.perf_counter() - t0
            if first:
                self.stats.prefill_s.append(dt)
                self.stats.prefill_tokens.append(sum(len(s) for s in running))
                first = False
            else:
                self.stats.decode_s.append(dt)
                self.stats.decode_batch.append(len(running))
            for s, tok in zip(running, sample_batch(logits, [s.params for s in running],
                                                    [s.generator for s in running])):
                s.output_ids.append(tok)
                check_finished(s, tok, self.eos_ids, self.config.max_positions, self.detokenize)
            running = [s for s in running if not s.finished]
        return seqs
