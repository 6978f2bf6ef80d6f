"""The transformers reference backend: the oracle in tests and a peer in benchmarks.

It runs the same token ids through ``AutoModelForCausalLM`` the way the seeds do:
batched, left-padded, position ids from the attention mask's cumulative sum, a
DynamicCache, and the same per-request samplers as qbench's engine.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Callable

import torch

from qbench.engine.engine import StepStats
from qbench.engine.sampling import SamplingParams, sample_batch
from qbench.engine.sequence import Sequence, make_sequences
from qbench.engine.stopping import check_finished


def load_hf_model(folder: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


class HFBackend:
    def __init__(self, model, max_positions: int, eos_ids: set[int], pad_id: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None):
        self.model = model
        self.max_positions = max_positions
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.detokenize = detokenize
        self.stats = StepStats()
        self.last_cache = None
        # transformers >= 5.x renamed past_key_values to cache
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 batch_size: int = 16) -> list[Sequence]:
        seqs = make_sequences(prompts, params, self.max_positions)
        for i in range(0, len(seqs), batch_size):
            self._run_batch(seqs[i: i + batch_size])
        return seqs

    def _run_batch(self, seqs: list[Sequence]) -> None:
        from transformers import DynamicCache

        T = max(len(s.prompt_ids) for s in seqs)
        ids = torch.tensor([[self.pad_id] * (T - len(s.prompt_ids)) + s.prompt_ids for s in seqs])  # (B, T)
        mask = torch.tensor([[0] * (T - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in seqs])
        # the seeds' fix: the first real token of every row gets position 0
        pos = mask.long().cumsum(-1) - 1
        pos.masked_fill_(mask == 0, 0)
        cache = DynamicCache()
        t0 = time.perf_counter()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                            **{self.cache_kw: cache}).logits[:, -1].float()
        self.stats.prefill_s.append(time.perf_counter() - t0)
        self.stats.prefill_tokens.append(sum(len(s) for s in seqs))
        while True:
            active = [i for i, s in enumerate(seqs) if not s.finished]
            tokens = sample_batch(logits[active], [seqs[i].params for i in active],
                                  [seqs[i].generator for i in active])
            for i, tok in zip(active, tokens):
                seqs[i].output_ids.append(tok)
                check_finished(seqs[i], tok, self.eos_ids, self.max_positions, self.detokenize)
            if all(s.finished for s in seqs):
                break
            nxt = torch.tensor([[s.output_ids[-1] if not s.finished else self.pad_id] for s in seqs])  # (B, 1)
            mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=mask.dtype)], dim=1)
            pos = mask.long().sum(-1, keepdim=True) - 1
            t0 = time.perf_counter()
            logits = self.model(input_ids=nxt, attention_mask=mask, position_ids=pos, use_cache=True,
                                **{self.cache_kw: cache}).logits[:, -1].float()
            self.stats.decode_s.append(time.perf_counter() - t0)
            self.stats.decode_batch.append(len(active))
        self.last_cache = cache
