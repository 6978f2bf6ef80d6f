"""What every model family shares: embed, run the blocks over the cache, project to logits."""

from __future__ import annotations

import torch

from qbench.layers.attention import AttnMetadata, build_mask, uses_kernel
from qbench.layers.kv import BlockKV
from qbench.models.config import ModelConfig


class CausalLM(torch.nn.Module):
    config: ModelConfig
    blocks: torch.nn.ModuleList
    final_norm: torch.nn.Module
    lm_head: torch.nn.Module

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_from_head(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings read from a tied lm_head stored (H, V): (B, T) -> (B, T, H)."""
        return self.lm_head.rows(input_ids.reshape(-1)).reshape(*input_ids.shape, self.lm_head.in_features)

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttnMetadata,
        caches: list[BlockKV] | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, V) at ``logits_index`` per row, else (B, T, V)."""
        cfg = self.config
        x = self.embed(input_ids, meta.positions)  # (B, T, H)
        mask = None
        if caches is None or not uses_kernel(meta, x.dtype) or not getattr(caches[0], "native", True):
            mask = build_mask(meta, cfg.num_heads // cfg.num_kv_heads, cfg.sliding_window)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, meta, None if caches is None else caches[i])
        if logits_index is not None:
            x = x[torch.arange(x.shape[0]), logits_index]  # (B, H)
        return self.lm_head(self.final_norm(x)).float()

    def weight_bytes(self) -> int:
        """Bytes held by weight tensors, counting a shared (tied) tensor once."""
        return unique_storage_bytes([*self.parameters(), *self.buffers()])


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: a tied lm_head shares the embedding's."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
