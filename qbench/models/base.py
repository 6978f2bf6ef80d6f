"""What every model family shares: embed, run the blocks over the cache, project to logits."""

from __future__ import annotations

import os

import torch

from qbench import heap
from qbench.layers.attention import AttnMetadata, build_mask, uses_kernel
from qbench.layers.fused_decode import FusedDecoder
from qbench.layers.kv import BlockKV
from qbench.models.config import ModelConfig


class CausalLM(torch.nn.Module):
    config: ModelConfig
    blocks: torch.nn.ModuleList
    final_norm: torch.nn.Module
    lm_head: torch.nn.Module
    tp = None  # tensor parallel: this rank's vocabulary slice, and the collectives that join the slices
    embed_attr: str  # the attribute that holds the embedding module (None while it is read from a tied head)
    embed_hf: str  # the embedding table's Hugging Face tensor prefix

    def embedding_table(self) -> torch.Tensor:
        """The token embedding table (V, H) as float32, wherever it is kept."""
        mod = getattr(self, self.embed_attr)
        return self.lm_head.weight.float() if mod is None else mod.weight.float()

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
        fused: FusedDecoder | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, V) at ``logits_index`` per row, else (B, T, V). ``fused`` (from
        ``fused_decoder``, over these caches) runs a decode step's layers in one native call."""
        cfg = self.config
        if self.tp is None:
            x = self.embed(input_ids, meta.positions)  # (B, T, H)
        else:  # vocab-parallel: rows of this rank's slice, zeros elsewhere, summed over ranks
            local = input_ids - self.tp.vocab[0]
            inside = (local >= 0) & (local < cfg.vocab_size)
            x = self.tp.all_reduce((self.embed(local.clamp(0, cfg.vocab_size - 1), meta.positions)
                                    * inside[..., None]).contiguous())
        out = None if fused is None else fused.run(x, meta)
        if out is not None:
            return self._logits(out, logits_index)
        mask = None
        c0 = None if caches is None else caches[0]
        # a quantized pool is read in place where its kernel takes the layout (decode and prefill: the kernel's
        # fixed order gives every CPU the same bits), dequantized whole otherwise
        in_place = getattr(c0, "native", True) or getattr(c0, "decode_kernel", False)
        if caches is None or not uses_kernel(meta, x.dtype) or not in_place:
            mask = build_mask(meta, cfg.num_heads // cfg.num_kv_heads, cfg.sliding_window)
        # each layer's temporaries reuse the memory of the last layer's (heap.scratch); the logits, which may
        # be (B, T, V) and outlive the pass, are left out
        with heap.scratch():
            for i, block in enumerate(self.blocks):
                x = block(x, mask, meta, None if caches is None else caches[i])
        return self._logits(x, logits_index)

    def _logits(self, x: torch.Tensor, logits_index: torch.Tensor | None) -> torch.Tensor:
        """Hidden states (B, T, H) after the last block -> logits (B, V) at ``logits_index``, else (B, T, V)."""
        if logits_index is not None:
            # (B, 1, H): one row per sequence, so the head picks its kernel by rows per sequence, not by B
            x = x[torch.arange(x.shape[0]), logits_index].unsqueeze(1)
        logits = self.lm_head(self.final_norm(x)).float()  # (B, T, V) or this rank's (B, T, V / p)
        if logits_index is not None:
            logits = logits.squeeze(1)  # (B, V)
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def fused_decoder(self, caches: list) -> FusedDecoder | None:
        """The one-call decode step over these caches, where every layer and cache allows it (and
        ``QBENCH_FUSED=0`` does not turn it off); None otherwise."""
        if os.environ.get("QBENCH_FUSED", "") == "0" or self.tp is not None:
            return None
        return FusedDecoder.build(self.blocks, caches)

    def weight_bytes(self) -> int:
        """Bytes held by weight tensors, counting a shared (tied) tensor once."""
        return unique_storage_bytes([*self.parameters(), *self.buffers()])

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: all but an embedding table of its own, of which a step reads
        only one row per sequence. A table tied to the head is read whole, by the head."""
        emb = getattr(self, self.embed_attr, None)
        if emb is None:
            return self.weight_bytes()
        prefix = self.embed_attr + "."
        rest = [t for n, t in [*self.named_parameters(), *self.named_buffers()] if not n.startswith(prefix)]
        return unique_storage_bytes(rest)


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: a tied lm_head shares the embedding's."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
