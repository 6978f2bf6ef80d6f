"""Build the right forward pass for a folder's config."""

from __future__ import annotations

from pathlib import Path

import torch

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
    tensors = load_state_dict(folder, dtype) if tensors is None else tensors
    if shard is not None:
        cfg, tensors = shard(cfg, tensors)
    model = FAMILIES[cfg.family](cfg, tensors, where=str(folder), factory=factory)
    model.eval()
    release_free_memory()
    return model


def release_free_memory() -> None:
    """Hand the C heap's free memory back to the system. Loading reads each tensor into a buffer and
    converts it (packs panels, unpacks codes); glibc keeps the freed buffers, 77 MiB of resident memory
    on SmolLM2 w4g64-head after loading (382 -> 305 MiB). No-op where the C library has no malloc_trim."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
