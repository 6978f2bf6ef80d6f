"""The Llama family (Llama, Mistral, SmolLM2, Qwen2): RMSNorm, RoPE, GQA, gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qbench.layers.attention import attend
from qbench.layers.linear import Linear
from qbench.layers.norm import RMSNorm
from qbench.kernels import build as kernels
from qbench.kernels.ops import silu_mul
from qbench.layers.rope import RopeTable, rotate_heads
from qbench.models.base import CausalLM
from qbench.models.config import ModelConfig
from qbench.models.weights import Weights

_ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaBlock(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, i: int, rope: RopeTable):
        super().__init__()
        self.rope, self.window = rope, cfg.sliding_window
        H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        p = f"layers.{i}."
        a = p + "self_attn."
        self.input_norm = RMSNorm(w.get(p + "input_layernorm.weight", (H,)), cfg.norm_eps)
        # q, k and v read the same input: one matmul
        self.qkv = w.linear([a + "q_proj", a + "k_proj", a + "v_proj"], [(nh * hd, H), (nkv * hd, H), (nkv * hd, H)])
        self.o_proj = w.linear([a + "o_proj"], [(H, nh * hd)])
        self.post_norm = RMSNorm(w.get(p + "post_attention_layernorm.weight", (H,)), cfg.norm_eps)
        m, I = p + "mlp.", cfg.intermediate_size
        self.gate_up = w.linear([m + "gate_proj", m + "up_proj"], [(I, H), (I, H)])
        self.down_proj = w.linear([m + "down_proj"], [(H, I)])
        self.act = _ACT[cfg.hidden_act]
        self.fused_silu = cfg.hidden_act == "silu"
        self.nh, self.nkv, self.hd, self.inter = nh, nkv, hd, I
        self.scale = hd ** -0.5
        self.reduce = None  # tensor parallel: the all-reduce after each row-parallel projection

    def forward(self, x, mask, meta, cache):
        B, T, _ = x.shape
        qkv = self.qkv(self.input_norm(x)).view(B, T, self.nh + 2 * self.nkv, self.hd)
        qk = rotate_heads(qkv, self.nh + self.nkv, meta.positions, self.rope)  # q and k rotate together
        q, k = qk[:, :, : self.nh], qk[:, :, self.nh:]
        v = qkv[:, :, self.nh + self.nkv:]
        x = x + self._sum(self.o_proj(attend(q, k, v, mask, meta, cache, self.scale, self.window)))
        gate_up = self.gate_up(self.post_norm(x))
        if self.fused_silu and gate_up.dtype == torch.float32 and kernels.available():
            return x + self._sum(self.down_proj(silu_mul(gate_up)))
        gate, up = gate_up.split(self.inter, dim=-1)
        return x + self._sum(self.down_proj(self.act(gate) * up))

    def fused_spec(self) -> dict | None:
        """What the one-call decode step (layers/fused_decode.py) needs of this layer; None where it runs another
        computation than this forward (another activation, or a tensor-parallel all-reduce)."""
        if not self.fused_silu or self.reduce is not None or self.input_norm.eps != self.post_norm.eps:
            return None
        return dict(H=self.input_norm.weight.shape[0], nh=self.nh, nkv=self.nkv, hd=self.hd, I=self.inter,
                    window=self.window, eps=self.input_norm.eps, scale=self.scale, norm_in=self.input_norm.weight,
                    norm_post=self.post_norm.weight, qkv=self.qkv, o=self.o_proj, gate_up=self.gate_up,
                    down=self.down_proj)

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums -> the full output (identity on one process)."""
        return partial if self.reduce is None else self.reduce(partial.contiguous())


class LlamaModel(CausalLM):
    embed_attr, embed_hf = "embed_tokens", "model.embed_tokens"

    def __init__(self, cfg: ModelConfig, tensors, where: str, factory=None):
        super().__init__()
        self.config = cfg
        w = Weights(tensors, where, prefixes=("model.",), factory=factory)
        V, H = cfg.vocab_size, cfg.hidden_size
        self.rope_table = RopeTable(cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.blocks = torch.nn.ModuleList(LlamaBlock(cfg, w, i, self.rope_table) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(w.get("norm.weight", (H,)), cfg.norm_eps)
        own_head = w.has_linear("lm_head") and (not cfg.tie_embeddings or w.is_quantized("lm_head"))
        dtype = self.final_norm.weight.dtype
        if own_head:
            self.lm_head = w.linear(["lm_head"], [(V, H)])
            # a tied model whose INT8 head is also its INT8 table stores no embedding of its own
            self.embed_tokens = w.embedding("embed_tokens", (V, H), dtype) if w.has_linear("embed_tokens") else None
        else:
            self.lm_head = Linear(w.get("embed_tokens.weight", (V, H)))  # tied: one buffer is head and table
            self.embed_tokens = None

    def untie(self, embedding: torch.nn.Module) -> None:
        """Give the model its own embedding module (a quantizer replacing a tied head, say)."""
        self.embed_tokens = embedding

    def embed(self, input_ids, positions):
        if self.embed_tokens is None:
            return self.embed_from_head(input_ids)
        return self.embed_tokens(input_ids)  # (B, T, H)

    def linear_map(self) -> list[tuple[str, list[tuple[str, int]]]]:
        """Each linear module -> the Hugging Face projections fused in it, with their row counts."""
        cfg, out = self.config, []
        q, kv, I = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        for i in range(cfg.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            out += [(f"blocks.{i}.qkv", [(a + "q_proj", q), (a + "k_proj", kv), (a + "v_proj", kv)]),
                    (f"blocks.{i}.o_proj", [(a + "o_proj", cfg.hidden_size)]),
                    (f"blocks.{i}.gate_up", [(m + "gate_proj", I), (m + "up_proj", I)]),
                    (f"blocks.{i}.down_proj", [(m + "down_proj", cfg.hidden_size)])]
        return out + [("lm_head", [("lm_head", cfg.vocab_size)])]

    def norm_map(self) -> dict[str, str]:
        """Norm modules whose weights a quantizer may rescale (AWQ) -> Hugging Face tensor prefix."""
        out = {f"blocks.{i}.{mod}": f"model.layers.{i}.{hf}" for i in range(self.config.num_layers)
               for mod, hf in (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm"))}
        return out | {"final_norm": "model.norm"}
