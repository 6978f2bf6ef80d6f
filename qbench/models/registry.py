"""Build the right forward pass for a folder's config."""

from __future__ import annotations

from pathlib import Path

import torch

from qbench import heap
from qbench.models.base import CausalLM
from qbench.models.config import ModelConfig
from qbench.models.gpt2 import GPT2Model
from qbench.models.llama import LlamaModel
from qbench.models.weights import load_state_dict

FAMILIES = {"llama": LlamaModel, "gpt2": GPT2Model}
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def load_model(folder: Path, dtype: torch.dtype = torch.float32, tensors=None, factory=None, shard=None) -> CausalLM:
    """A model from a Hugging Face folder; ``tensors``/``factory`` let an artifact supply its own.
    ``shard(cfg, tensors) -> (cfg, tensors)`` builds one tensor-parallel rank's part instead."""
    cfg = ModelConfig.from_folder(folder)
    heap.fix_mmap_threshold()  # from here on, the peak RSS of a run does not depend on the order of frees
    tensors = load_state_dict(folder, dtype) if tensors is None else tensors
    if shard is not None:
        cfg, tensors = shard(cfg, tensors)
    model = FAMILIES[cfg.family](cfg, tensors, where=str(folder), factory=factory)
    model.eval()
    heap.release_free_memory()
    return model
