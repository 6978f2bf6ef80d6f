"""A model's shape, read from a Hugging Face config.json and checked on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from qbench.errors import QBenchError

# Hugging Face model_type -> the qbench forward pass that runs it
SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2"}
ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_positions: int
    tie_embeddings: bool
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.family not in ("llama", "gpt2"):
            raise QBenchError(f"unknown model family {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_positions"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise QBenchError(f"config: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise QBenchError(f"config: num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise QBenchError(f"config: hidden activation {self.hidden_act!r} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise QBenchError(f"{folder}: no config.json; pass a Hugging Face model folder "
                              f"(config.json + model.safetensors) or run `qbench pull smollm2-135m-instruct`")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise QBenchError(f"{path}: not valid JSON ({e}); re-create the model folder") from None
        return cls.from_hf(raw, where=str(path))

    @classmethod
    def from_hf(cls, d: dict, where: str = "config.json") -> "ModelConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED:
            raise QBenchError(f"{where}: architecture model_type={mt!r} is not supported "
                              f"(supported: {', '.join(sorted(SUPPORTED))})")

        def need(*keys):
            for k in keys:
                if d.get(k) is not None:
                    return d[k]
            raise QBenchError(f"{where}: missing field {keys[0]!r} for model_type {mt!r}")

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if SUPPORTED[mt] == "gpt2":
            hidden = need("n_embd")
            heads = need("n_head")
            if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn"):
                raise QBenchError(f"{where}: GPT-2 variants with scale_attn_by_inverse_layer_idx or "
                                  f"reorder_and_upcast_attn are not supported")
            return cls(family="gpt2", model_type=mt, vocab_size=need("vocab_size"), hidden_size=hidden,
                       num_layers=need("n_layer"), num_heads=heads, num_kv_heads=heads,
                       head_dim=hidden // heads, intermediate_size=d.get("n_inner") or 4 * hidden,
                       norm_eps=float(d.get("layer_norm_epsilon", 1e-5)), max_positions=need("n_positions"),
                       tie_embeddings=True, hidden_act=d.get("activation_function", "gelu_new"),
                       eos_token_ids=eos_ids)
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] not in ("default", "linear", "llama3"):
                raise QBenchError(f"{where}: rope scaling {scaling['rope_type']!r} is not supported "
                                  f"(supported: default, linear, llama3)")
        window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        max_pos = need("max_position_embeddings")
        return cls(family="llama", model_type=mt, vocab_size=need("vocab_size"), hidden_size=hidden,
                   num_layers=need("num_hidden_layers"), num_heads=heads,
                   num_kv_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or hidden // heads, intermediate_size=need("intermediate_size"),
                   norm_eps=float(d.get("rms_norm_eps", 1e-6)), max_positions=max_pos,
                   tie_embeddings=bool(d.get("tie_word_embeddings", False)), hidden_act=d.get("hidden_act", "silu"),
                   rope_theta=float(theta), rope_scaling=scaling,
                   sliding_window=window if window and window < max_pos else None, eos_token_ids=eos_ids)
