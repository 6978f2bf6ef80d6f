"""The KV cache a recipe's ``kv`` section asks for: how blocks are stored (quantized, 16-bit or the model's
own dtype) and, optionally, which tokens are evicted under a budget; and its exact bytes per token."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from qbench.layers.eviction import POLICIES, Eviction
from qbench.layers.kvquant import BITS, Codec

SCHEMES = ("kivi", "fp8", "per-tensor", "per-token-k", "fp16", "bf16", "fp")
# full precision: stored narrower than fp32, or (fp) in the model's own dtype
FP_SCHEMES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp": None}


@dataclass(frozen=True)
class KVScheme:
    """A KV cache: bit widths of K and V (16 keeps one in full precision), the K group of G tokens (the
    engine's block size), channels per V group, the full-precision residual window R (a multiple of G) and
    the scheme: kivi, fp8, the naive baselines per-tensor and per-token-k, or fp16 / bf16, an unquantized
    cache stored in 16 bits (llama.cpp's and vLLM's default, the fair baseline for the quantized ones).
    The bits default to 8, and to 16 for fp16 and bf16."""

    k_bits: int | None = None
    v_bits: int | None = None
    group: int = 16
    v_group: int = 32
    residual: int = 16
    scheme: str = "kivi"
    evict: str = "none"  # none, streaming, h2o, snapkv (layers/eviction.py)
    budget: int | float | None = None  # tokens, or a fraction of each prompt
    sinks: int = 4
    window: int | None = None
    pool: int = 5

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, 16 if self.scheme in FP_SCHEMES else 8)
        for name in ("k_bits", "v_bits"):
            v = getattr(self, name)
            if v not in BITS + (16,):
                raise ValueError(f"kv.{name}: {v!r} is not supported (supported: 8, 4, 2, or 16 for full precision)")
        if self.scheme not in SCHEMES:
            raise ValueError(f"kv.scheme: {self.scheme!r} is not one of {', '.join(SCHEMES)}")
        if self.scheme == "fp8" and (self.k_bits, self.v_bits) != (8, 8):
            raise ValueError("kv.scheme: fp8 stores 8 bits for K and V; set k_bits and v_bits to 8")
        if self.scheme in FP_SCHEMES and (self.k_bits, self.v_bits) != (16, 16):
            raise ValueError(f"kv.scheme: {self.scheme} stores K and V unquantized; drop k_bits and v_bits, or use "
                             f"kivi for a quantized cache")
        for name in ("group", "v_group", "residual"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"kv.{name}: {v!r} must be a positive integer")
        if self.residual % self.group:
            raise ValueError(f"kv.residual: {self.residual} must be a multiple of kv.group ({self.group})")
        if self.evict not in POLICIES:
            raise ValueError(f"kv.evict: {self.evict!r} is not one of {', '.join(POLICIES)}")
        if self.evict == "none" and self.budget is not None:
            raise ValueError("kv.budget: a budget needs an eviction policy; set kv.evict (streaming, h2o, snapkv)")
        if self.evict != "none":
            if self.budget is None:
                raise ValueError(f"kv.evict: {self.evict} needs kv.budget (tokens, or a fraction of the prompt)")
            self.eviction  # validates the policy's fields

    @property
    def eviction(self) -> Eviction | None:
        if self.evict == "none":
            return None
        return Eviction(self.evict, self.budget, self.sinks, self.window, self.pool)

    @property
    def quantized(self) -> bool:
        return (self.k_bits, self.v_bits) != (16, 16)

    @property
    def storage_dtype(self) -> torch.dtype | None:
        """The dtype of an unquantized cache (fp16, bf16); None: the model's own."""
        return FP_SCHEMES.get(self.scheme)

    @property
    def windows(self) -> int:
        """Blocks of full-precision residual per sequence."""
        return self.residual // self.group

    def codecs(self) -> tuple[Codec, Codec]:
        def one(bits: int, mode: str) -> Codec:
            if bits == 16:
                return Codec("none", 16)
            return Codec(mode, bits, self.v_group)
        k_mode = {"kivi": "channel", "fp8": "fp8", "per-tensor": "tensor", "per-token-k": "token"}[self.scheme]
        v_mode = {"fp8": "fp8", "per-tensor": "tensor"}.get(self.scheme, "token")
        return one(self.k_bits, k_mode), one(self.v_bits, v_mode)

    def check(self, block_size: int, head_dim: int) -> None:
        if self.group != block_size:
            raise ValueError(f"kv.group: {self.group} must equal the engine's block size ({block_size}): "
                             f"each block is one K group")
        if any(c.mode == "token" for c in self.codecs()) and head_dim % self.v_group:
            raise ValueError(f"kv.v_group: {self.v_group} does not divide the model's head_dim {head_dim}")

    def bytes_per_token(self, num_layers: int, nkv: int, hd: int, fp_bytes: int = 4) -> float:
        """Bytes per cached token in steady state, all layers; the residual window is a fixed per-sequence
        overhead (``residual_bytes``) on top."""
        if self.storage_dtype is not None:
            return 2 * num_layers * nkv * hd * 2
        k, v = self.codecs()
        G = self.group
        return num_layers * (k.block_bytes(G, nkv, hd, fp_bytes) + v.block_bytes(G, nkv, hd, fp_bytes)) / G

    def residual_bytes(self, num_layers: int, nkv: int, hd: int, fp_bytes: int = 4) -> int:
        if not self.quantized:
            return 0  # no residual ring
        return num_layers * 2 * self.residual * nkv * hd * fp_bytes

    def describe(self) -> str:
        ev = self.eviction
        if ev is not None:
            return f"{replace(self, evict='none', budget=None).describe()} + {ev.describe()}"
        if not self.quantized:
            return self.scheme if self.scheme in FP_SCHEMES else "fp"
        name = {"kivi": "", "fp8": "fp8 ", "per-tensor": "per-tensor ", "per-token-k": "per-token-K "}[self.scheme]
        return f"{name}K{self.k_bits}V{self.v_bits} G{self.group} R{self.residual}"

    def to_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


def kv_memory(scheme: KVScheme | None, num_layers: int, nkv: int, hd: int, fp_bytes: int = 4) -> dict:
    """Exact KV bytes per token of ``scheme`` (None: the full-precision cache) against fp16 and fp32 caches."""
    fp16 = 2 * num_layers * nkv * hd * 2
    fp32 = 2 * fp16
    if scheme is not None and scheme.storage_dtype is not None:
        fp_bytes = 2
    if scheme is None or not scheme.quantized:
        per, resid = 2 * num_layers * nkv * hd * fp_bytes, 0
    else:
        per, resid = scheme.bytes_per_token(num_layers, nkv, hd, fp_bytes), scheme.residual_bytes(
            num_layers, nkv, hd, fp_bytes)
    return {"scheme": "fp" if scheme is None else scheme.describe(), "bytes_per_token": per,
            "fp16_bytes_per_token": fp16, "fp32_bytes_per_token": fp32, "vs_fp16": per / fp16, "vs_fp32": per / fp32,
            "residual_bytes_per_sequence": resid}
