"""The model under evaluation: an fp model or an artifact on qbench's engine, with its KV-cache scheme.

Every eval talks to it through two calls: ``logprobs`` (teacher-forced scoring, one prefill per window)
and ``generate``. Both go through the engine's cache, so a quantized KV cache is what gets scored.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qbench.engine.api import Generator
from qbench.engine.sampling import SamplingParams


class Subject:
    def __init__(self, model: str, batch_size: int, kv_scheme=None):
        self.spec = model
        self.gen = Generator(model, backend="qbench", max_batch=batch_size, kv_scheme=kv_scheme)
        self.engine = self.gen.backend
        self.tokenizer = self.gen.tokenizer
        self.folder: Path = self.gen.folder
        self.batch_size = batch_size
        self.kv_scheme = self.engine.kv_scheme

    def describe(self) -> dict:
        from qbench.quant.quantize import source_sha256
        m = self.gen.manifest
        return {"model": self.spec, "folder": str(self.folder), "weights_sha256": source_sha256(self.folder),
                "recipe": None if m is None else m["recipe"]["name"],
                "kv": None if self.kv_scheme is None else self.kv_scheme.to_dict(),
                "weight_bytes": self.engine.model.weight_bytes()}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def logprobs(self, windows: list[list[int]]) -> list[torch.Tensor]:
        """log-softmax (T, V) at every position of each window."""
        return self.engine.score(windows)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
        return self.engine.generate(prompts, params)
