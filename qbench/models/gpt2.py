"""GPT-2: learned absolute positions, LayerNorm, Conv1D weights stored (in, out)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qbench.layers.attention import attend
from qbench.layers.linear import Linear
from qbench.layers.norm import LayerNorm
from qbench.models.base import CausalLM
from qbench.models.config import ModelConfig
from qbench.models.weights import Weights


def _conv1d(w: Weights, name: str, n_in: int, n_out: int):
    # Conv1D keeps (in, out); a linear layer wants (out, in)
    return w.linear([name], [(n_out, n_in)], conv1d=True)


class GPT2Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, i: int):
        super().__init__()
        H, I, p = cfg.hidden_size, cfg.intermediate_size, f"h.{i}."
        self.ln_1 = LayerNorm(w.get(p + "ln_1.weight", (H,)), w.get(p + "ln_1.bias", (H,)), cfg.norm_eps)
        self.qkv = _conv1d(w, p + "attn.c_attn", H, 3 * H)
        self.o_proj = _conv1d(w, p + "attn.c_proj", H, H)
        self.ln_2 = LayerNorm(w.get(p + "ln_2.weight", (H,)), w.get(p + "ln_2.bias", (H,)), cfg.norm_eps)
        self.fc = _conv1d(w, p + "mlp.c_fc", H, I)
        self.down_proj = _conv1d(w, p + "mlp.c_proj", I, H)
        self.nh, self.hd = cfg.num_heads, cfg.head_dim
        self.scale = self.hd ** -0.5
        self.approximate = "none" if cfg.hidden_act == "gelu" else "tanh"

    def forward(self, x, mask, meta, cache):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(B, T, 3, self.nh, self.hd).unbind(2)
        x = x + self.o_proj(attend(q, k, v, mask, meta, cache, self.scale))
        return x + self.down_proj(F.gelu(self.fc(self.ln_2(x)), approximate=self.approximate))


class GPT2Model(CausalLM):
    embed_attr, embed_hf = "wte", "transformer.wte"

    def __init__(self, cfg: ModelConfig, tensors, where: str, factory=None):
        super().__init__()
        self.config = cfg
        w = Weights(tensors, where, prefixes=("transformer.",), factory=factory)
        V, H = cfg.vocab_size, cfg.hidden_size
        self.wpe = torch.nn.Parameter(w.get("wpe.weight", (cfg.max_positions, H)), requires_grad=False)
        self.blocks = torch.nn.ModuleList(GPT2Block(cfg, w, i) for i in range(cfg.num_layers))
        self.final_norm = LayerNorm(w.get("ln_f.weight", (H,)), w.get("ln_f.bias", (H,)), cfg.norm_eps)
        if w.is_quantized("lm_head"):
            self.lm_head = w.linear(["lm_head"], [(V, H)])
            self.wte = w.embedding("wte", (V, H), self.final_norm.weight.dtype) if w.has_linear("wte") else None
        else:
            self.lm_head = Linear(w.get("wte.weight", (V, H)))  # tied: also the token embedding
            self.wte = None

    def untie(self, embedding: torch.nn.Module) -> None:
        """Give the model its own embedding module (a quantizer replacing the tied head, say)."""
        self.wte = embedding

    def embed(self, input_ids, positions):
        tok = self.embed_from_head(input_ids) if self.wte is None else self.wte(input_ids)
        return tok + self.wpe[positions]

    def linear_map(self) -> list[tuple[str, list[tuple[str, int]]]]:
        cfg, out = self.config, []
        H = cfg.hidden_size
        for i in range(cfg.num_layers):
            p = f"h.{i}."
            out += [(f"blocks.{i}.qkv", [(p + "attn.c_attn", 3 * H)]), (f"blocks.{i}.o_proj", [(p + "attn.c_proj", H)]),
                    (f"blocks.{i}.fc", [(p + "mlp.c_fc", cfg.intermediate_size)]),
                    (f"blocks.{i}.down_proj", [(p + "mlp.c_proj", H)])]
        return out + [("lm_head", [("lm_head", cfg.vocab_size)])]

    def norm_map(self) -> dict[str, str]:
        out = {f"blocks.{i}.{m}": f"h.{i}.{m}" for i in range(self.config.num_layers) for m in ("ln_1", "ln_2")}
        return out | {"final_norm": "ln_f"}
