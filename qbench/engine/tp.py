"""Tensor parallelism (Megatron-style) for the Llama family over torch.distributed.

Each rank builds its own part of the model straight from the checkpoint (no rank ever holds the whole):
- q/k/v and gate/up are column-parallel: rank r keeps its attention heads (whole KV-head groups, so GQA
  stays local) and its slice of the MLP's intermediate columns;
- o_proj and down_proj are row-parallel: the matching input columns; their partial outputs are summed
  with one all-reduce each;
- the embedding and lm_head are vocab-parallel: rank r keeps its rows; embeddings are summed over the
  ranks, logits gathered.
The KV cache holds only the rank's KV heads. Quantized weights are sliced along their groups: a shard
boundary must fall on a group boundary (and is refused otherwise), so no group straddles two ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from qbench.errors import QBenchError
from qbench.models.config import ModelConfig

_ROW = re.compile(r"\.(?:self_attn\.([qkv])_proj|mlp\.(gate|up)_proj)\.(weight|bias|qweight|scales|zeros)$")
_COL = re.compile(r"\.(?:self_attn\.(o)_proj|mlp\.(down)_proj)\.(weight|bias|qweight|scales|zeros)$")
_VOCAB = re.compile(r"(?:^|\.)(embed_tokens\.weight|lm_head\.(?:weight|qweight|scales|zeros))$")


def split(n: int, world: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """[start, end) of rank's share of n items dealt in whole units as evenly as possible (first ranks
    take the remainder); the last rank's end is n even when n is not a multiple of unit."""
    units = -(-n // unit)
    base, extra = divmod(units, world)
    start = rank * base + min(rank, extra)
    end = start + base + (rank < extra)
    return min(start * unit, n), min(end * unit, n)


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    kv_heads: tuple[int, int]
    heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]
    head_dim: int

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int, world: int, unit: int = 1) -> "Shard":
        if cfg.family != "llama":
            raise QBenchError(f"tensor parallelism supports the Llama family (Llama, Mistral, SmolLM2, Qwen2), "
                              f"not {cfg.model_type}")
        if cfg.num_kv_heads < world:
            raise QBenchError(f"tensor parallel degree {world} is more than the model's {cfg.num_kv_heads} KV "
                              f"heads; use at most {cfg.num_kv_heads} processes")
        g = split(cfg.num_kv_heads, world, rank)
        group = cfg.num_heads // cfg.num_kv_heads
        return cls(rank, world, g, (g[0] * group, g[1] * group), split(cfg.intermediate_size, world, rank, unit),
                   split(cfg.vocab_size, world, rank), cfg.head_dim)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        return replace(cfg, num_heads=self.heads[1] - self.heads[0], num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                       intermediate_size=self.inter[1] - self.inter[0], vocab_size=self.vocab[1] - self.vocab[0])


class ShardedTensors:
    """A rank's view of a checkpoint's tensors: every projection sliced to its shard, as it is read."""

    def __init__(self, inner, shard: Shard, cfg: ModelConfig, scheme: dict | None):
        self.inner, self.s, self.cfg, self.scheme = inner, shard, cfg, scheme

    def __contains__(self, name: str) -> bool:
        return name in self.inner

    def keys(self):
        return self.inner.keys()

    def _range(self, proj: str) -> tuple[int, int]:
        hd, s = self.s.head_dim, self.s
        return {"q": (s.heads[0] * hd, s.heads[1] * hd), "o": (s.heads[0] * hd, s.heads[1] * hd),
                "k": (s.kv_heads[0] * hd, s.kv_heads[1] * hd), "v": (s.kv_heads[0] * hd, s.kv_heads[1] * hd),
                "gate": s.inter, "up": s.inter, "down": s.inter}[proj]

    def get(self, name: str, default=None, **kw):
        """The shard of ``name``; ``kw`` (keep_dtype, mapped) goes to the full mapping's get."""
        if name not in self.inner:
            return default
        t = self.inner.get(name, **kw)
        if m := _ROW.search(name):
            a, b = self._range(m.group(1) or m.group(2))
            return t[a:b].contiguous()
        if m := _COL.search(name):
            return self._columns(name, t, *self._range(m.group(1) or m.group(2)), m.group(3))
        if _VOCAB.search(name):
            a, b = self.s.vocab
            return t[a:b].contiguous()
        return t

    def _columns(self, name: str, t: torch.Tensor, a: int, b: int, kind: str) -> torch.Tensor:
        """Input columns [a, b) of a row-parallel projection, in the stored layout."""
        if kind == "bias":  # added once: by rank 0
            return t if self.s.rank == 0 else torch.zeros_like(t)
        if kind == "weight":
            return t[:, a:b].contiguous()
        bits = self.scheme["bits"]
        if bits == 8:  # per-output-channel scales apply to the whole row
            return t if kind == "scales" else t[:, a:b].contiguous()
        g = self.scheme["group_size"]
        full = b == self._width(name)
        for edge in (a,) if full else (a, b):
            if edge % g:
                raise QBenchError(f"tensor parallel: {name.rsplit('.', 1)[0]} would be cut at input column {edge}, "
                                  f"inside a quantization group of {g}; choose a degree whose shards hold whole "
                                  f"groups")
        per = 2 if kind == "qweight" else g  # packed nibbles, or one scale (zero) per group
        stop = t.shape[1] if full else b // per
        return t[:, a // per: stop].contiguous()

    def _width(self, name: str) -> int:
        return self.cfg.num_heads * self.cfg.head_dim if ".o_proj." in name else self.cfg.intermediate_size


class TPRuntime:
    """What the model's forward needs from the other ranks."""

    def __init__(self, coll, shard: Shard, sizes: list[int]):
        self.coll, self.vocab, self.sizes = coll, shard.vocab, sizes

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.coll.all_reduce(t)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return self.coll.all_gather_last(logits, self.sizes)


def load_tp_model(folder: Path, dtype: torch.dtype, coll, is_artifact: bool):
    """This rank's part of the model (an HF folder or a qbench artifact), wired to ``coll``."""
    import torch.distributed as dist

    from qbench.models.registry import load_model
    from qbench.quant.artifact import load_artifact

    rank, world = dist.get_rank(coll.group), dist.get_world_size(coll.group)
    shards = {}

    def shard(cfg: ModelConfig, tensors, scheme=None):
        unit = scheme["group_size"] if scheme and scheme.get("bits") == 4 else 1
        shards["cfg"] = cfg
        shards["all"] = [Shard.plan(cfg, r, world, unit) for r in range(world)]
        s = shards["all"][rank]
        return s.local_config(cfg), ShardedTensors(tensors, s, cfg, scheme)

    if is_artifact:
        model, manifest = load_artifact(folder, dtype, shard=shard)
    else:
        model, manifest = load_model(folder, dtype, shard=shard), None
    parts = shards["all"]
    model.tp = TPRuntime(coll, parts[rank], [p.vocab[1] - p.vocab[0] for p in parts])
    model.full_config = shards["cfg"]
    for block in model.blocks:
        block.reduce = coll.all_reduce
    return model, manifest, parts[rank]
