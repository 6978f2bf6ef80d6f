"""Text in, text out: resolve a model, tokenize, run a backend, report each completion."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


from qbench.engine.engine import Engine
from qbench.engine.hf_backend import HFBackend, load_hf_model
from qbench.engine.nocache import NoCacheEngine
from qbench.engine.sampling import SamplingParams
from qbench.errors import QBenchError
from qbench.models.config import ModelConfig
from qbench.models.registry import DTYPES, load_model
from qbench.models.zoo import resolve_model
from qbench.quant.artifact import artifact_kv_scheme, is_artifact, load_artifact

BACKENDS = ("qbench", "hf", "nocache")


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types for a broken folder
        raise QBenchError(f"{folder}: cannot load the tokenizer ({str(e).splitlines()[0][:120]}); the folder "
                          f"needs tokenizer.json and tokenizer_config.json") from None


@dataclass
class Completion:
    prompt: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str


class Generator:
    def __init__(self, model: str, backend: str = "qbench", dtype: str = "fp32", block_size: int = 16,
                 max_batch: int = 16, kv_scheme=None, prefix_cache: bool = True, tp: str | None = None):
        if backend not in BACKENDS:
            raise QBenchError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if dtype not in DTYPES:
            raise QBenchError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        self.folder = resolve_model(model)
        cfg = ModelConfig.from_folder(self.folder)  # config and weight errors come before the tokenizer's
        torch_dtype = DTYPES[dtype]
        self.max_batch = max_batch
        self.manifest = None
        self.tp_rank = 0
        qmodel = None
        if tp is not None:
            if backend != "qbench":
                raise QBenchError("tensor parallelism runs on qbench's engine; drop --backend")
            from qbench.dist.comm import Dist
            from qbench.dist.ring import Collective
            from qbench.engine.tp import load_tp_model
            d = Dist.from_env(required=True)
            self.tp_rank = d.rank
            qmodel, self.manifest, self.shard = load_tp_model(self.folder, torch_dtype, Collective(tp),
                                                              is_artifact(self.folder))
            if kv_scheme is None and self.manifest is not None:
                kv_scheme = artifact_kv_scheme(self.manifest, str(self.folder))
        elif backend != "hf":
            if is_artifact(self.folder):
                qmodel, self.manifest = load_artifact(self.folder, torch_dtype)
                if kv_scheme is None:
                    kv_scheme = artifact_kv_scheme(self.manifest, str(self.folder))
            else:
                qmodel = load_model(self.folder, torch_dtype)
        elif is_artifact(self.folder):
            raise QBenchError(f"{self.folder}: a qbench artifact runs on qbench's engine; export it with "
                              f"`qbench export` for transformers, or drop --backend hf")
        elif kv_scheme is not None:
            raise QBenchError("a quantized KV cache runs on qbench's engine only; drop --kv or --backend hf")
        self.tokenizer = load_tokenizer(self.folder)
        detok = self.detokenize
        if backend == "hf":
            self.backend = HFBackend(load_hf_model(self.folder, torch_dtype), cfg.max_positions,
                                     self.eos_ids(cfg.eos_token_ids), pad_id=self._pad_id(), detokenize=detok)
        else:
            if backend == "nocache" and kv_scheme is None:
                self.backend = NoCacheEngine(qmodel, detokenize=detok)
            elif backend == "qbench":
                if kv_scheme is not None:
                    block_size = kv_scheme.group  # each block is one K group
                self.backend = Engine(qmodel, block_size=block_size, max_batch=max_batch, detokenize=detok,
                                      kv_scheme=kv_scheme, prefix_cache=prefix_cache)
            elif kv_scheme is not None:
                raise QBenchError("the nocache backend keeps no KV cache to quantize; drop --kv or the kv artifact")
            self.backend.eos_ids = self.eos_ids(qmodel.config.eos_token_ids)

    def eos_ids(self, config_eos: tuple[int, ...]) -> set[int]:
        ids = set(config_eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        tok = self.tokenizer
        if chat:
            if not tok.chat_template:
                raise QBenchError(f"{self.folder}: the tokenizer has no chat template; drop --chat")
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return tok(prompt)["input_ids"]

    def sample_n(self, prompt: str, params: SamplingParams, n: int, chat: bool = False) -> tuple[list[Completion], str]:
        """``n`` samples of one prompt whose KV blocks they share -> completions and a line on the memory saved."""
        eng = self.backend
        ids = self.encode(prompt, chat)
        peak = [0]
        eng.observer = lambda sched, step: peak.__setitem__(0, max(peak[0], eng.blocks.num_used))
        try:
            seqs = eng.generate_n(ids, params, n)
        finally:
            eng.observer = None
        alone = sum(eng.blocks.blocks_for(len(s) - 1) for s in seqs)  # each sample's cache on its own
        per_block = eng.pool.block_nbytes
        line = (f"{n} samples share the prompt's {len(ids) // eng.block_size} full blocks: peak KV {peak[0]} blocks "
                f"({peak[0] * per_block / 2**20:.1f} MiB) against {alone} unshared "
                f"({alone * per_block / 2**20:.1f} MiB); {eng.blocks.copies} copy-on-write copies")
        return [Completion(prompt, s.text, s.output_ids, len(s.prompt_ids), s.finish_reason) for s in seqs], line

    def generate(self, prompts: list[str], params: list[SamplingParams] | SamplingParams,
                 chat: bool = False) -> list[Completion]:
        ids = [self.encode(p, chat) for p in prompts]
        kwargs = {"batch_size": self.max_batch} if isinstance(self.backend, HFBackend) else {}
        seqs = self.backend.generate(ids, params, **kwargs)
        return [Completion(p, s.text, s.output_ids, len(s.prompt_ids), s.finish_reason) for p, s in zip(prompts, seqs)]
