"""The Llama family (Llama, Mistral, SmolLM2, Qwen2): RMSNorm, RoPE, GQA, gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qbench.errors import QBenchError
from qbench.layers.attention import attend
from qbench.layers.linear import Linear, fuse
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
        self.qkv = fuse([(w.get(a + "q_proj.weight", (nh * hd, H)), w.maybe(a + "q_proj.bias")),
                         (w.get(a + "k_proj.weight", (nkv * hd, H)), w.maybe(a + "k_proj.bias")),
                         (w.get(a + "v_proj.weight", (nkv * hd, H)), w.maybe(a + "v_proj.bias"))])
        self.o_proj = Linear(w.get(a + "o_proj.weight", (H, nh * hd)), w.maybe(a + "o_proj.bias"))
        self.post_norm = RMSNorm(w.get(p + "post_attention_layernorm.weight", (H,)), cfg.norm_eps)
        m, I = p + "mlp.", cfg.intermediate_size
        self.gate_up = fuse([(w.get(m + "gate_proj.weight", (I, H)), w.maybe(m + "gate_proj.bias")),
                             (w.get(m + "up_proj.weight", (I, H)), w.maybe(m + "up_proj.bias"))])
        self.down_proj = Linear(w.get(m + "down_proj.weight", (H, I)), w.maybe(m + "down_proj.bias"))
        self.act = _ACT[cfg.hidden_act]
        self.fused_silu = cfg.hidden_act == "silu"
        self.nh, self.nkv, self.hd, self.inter = nh, nkv, hd, I
        self.scale = hd ** -0.5

    def forward(self, x, mask, meta, cache):
        B, T, _ = x.shape
        qkv = self.qkv(self.input_norm(x)).view(B, T, self.nh + 2 * self.nkv, self.hd)
        qk = rotate_heads(qkv, self.nh + self.nkv, meta.positions, self.rope)  # q and k rotate together
        q, k = qk[:, :, : self.nh], qk[:, :, self.nh:]
        v = qkv[:, :, self.nh + self.nkv:]
        x = x + self.o_proj(attend(q, k, v, mask, meta, cache, self.scale, self.window))
        gate_up = self.gate_up(self.post_norm(x))
        if self.fused_silu and gate_up.dtype == torch.float32 and kernels.available():
            return x + self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return x + self.down_proj(self.act(gate) * up)


class LlamaModel(CausalLM):
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], where: str):
        super().__init__()
        self.config = cfg
        w = Weights(tensors, where, prefixes=("model.",))
        V, H = cfg.vocab_size, cfg.hidden_size
        embed = w.get("embed_tokens.weight", (V, H))
        self.rope_table = RopeTable(cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.blocks = torch.nn.ModuleList(LlamaBlock(cfg, w, i, self.rope_table) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(w.get("norm.weight", (H,)), cfg.norm_eps)
        head = tensors.get("lm_head.weight")
        if head is None and not cfg.tie_embeddings:
            raise QBenchError(f"{where}: lm_head.weight is missing and tie_word_embeddings is false")
        self.tied = cfg.tie_embeddings or head is None
        # tied: one (H, V) buffer serves as both lm_head and the embedding table
        self.lm_head = Linear(embed if self.tied else head)
        self.embed_tokens = None if self.tied else torch.nn.Parameter(embed, requires_grad=False)

    def embed(self, input_ids, positions):
        if self.embed_tokens is None:
            return self.embed_from_head(input_ids)
        return self.embed_tokens[input_ids]
