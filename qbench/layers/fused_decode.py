"""A decode step's decoder layers in one native call (``qb_decode_layers``, kernels/layer.c).

The layer-by-layer path makes about a dozen kernel calls per layer from Python, and the Python between them
costs about as much as the kernels themselves on a small model at batch 1. ``FusedDecoder`` describes every
layer once (weights, norms, this pool's tensors) in ctypes structures and runs a decode step's layers in one
call, through the same kernels in the same order, so its hidden states are bit-identical to the
layer-by-layer path, which stays the reference (tests/test_fused_decode.py).

It applies to decode steps (one new token per row) of the Llama family with every linear on a native
layout (fp32 panels, INT8, INT4), on an fp32, fp16/bf16 or in-place-readable quantized pool, on one
process. Anything else (prefill, gpt2, tensor parallel, the aten/reference linears, the naive KV baselines)
takes the layer-by-layer path. The weights and the pool must not be replaced while a decoder lives: the
engine makes one per runner, and a new pool gets a new runner.
"""

from __future__ import annotations

import ctypes

import torch

from qbench.kernels import build as kernels
from qbench.kernels import ops
from qbench.layers.kv import BlockKV, QuantBlockKV

LIN_F32, LIN_I8, LIN_I4, LIN_I4A8, LIN_I8A8, LIN_F8 = range(6)
POOL_F32, POOL_F16, POOL_BF16, POOL_QUANT = range(4)
STAGE_WRITE, STAGE_REST = 1, 2
_P, _L, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Lin(ctypes.Structure):
    _fields_ = [("kind", _L), ("K", _L), ("N", _L), ("G", _L), ("w", _P), ("s", _P), ("z", _P), ("bias", _P),
                ("rot", _L)]


class Layer(ctypes.Structure):
    _fields_ = ([(n, _L) for n in ("H", "nh", "nkv", "hd", "I", "window", "pool", "W")]
                + [("eps", _F), ("scale", _F), ("norm_in", _P), ("norm_post", _P)]
                + [(n, Lin) for n in ("qkv", "o", "gate_up", "down")]
                + [("k", _P), ("v", _P)]
                + [(n, _L) for n in ("kmode", "kbits", "vmode", "vbits", "vgroup")]
                + [(n, _P) for n in ("kc", "ks", "km", "vc", "vs", "vm")])


class Step(ctypes.Structure):
    _fields_ = ([(n, _L) for n in ("B", "bs", "nblk")] + [(n, _P) for n in (
        "positions", "slots", "tables", "ctx", "kv_slots", "cos", "sin", "kvpos")]
        + [("nleave", _L), ("leave_ring", _P), ("leave_blk", _P)])


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def linear_desc(lin) -> Lin | None:
    """A linear on one of the native layouts -> its description; None otherwise."""
    bias = getattr(lin, "bias", None)
    if getattr(lin, "packed", None) is not None:  # fp32 panels (layers.linear.Linear)
        return Lin(LIN_F32, lin.in_features, lin.out_features, 0, _ptr(lin.packed), 0, 0, _ptr(bias))
    if getattr(lin, "impl", None) != "native":
        return None
    if lin.bits == 8:
        kind = LIN_F8 if lin.type == "float" else LIN_I8A8 if lin.activations == "int8" else LIN_I8
        return Lin(kind, lin.in_features, lin.out_features, 0, _ptr(lin.panels), _ptr(lin.scale32), 0,
                   _ptr(bias), lin.hadamard)
    kind = LIN_I4A8 if lin.activations == "int8" else LIN_I4
    return Lin(kind, lin.in_features, lin.out_features, lin.group_size, _ptr(lin.panels), _ptr(lin.scales16),
               _ptr(lin.zeros8), _ptr(bias), lin.hadamard)


def _pool_fields(cache) -> dict | None:
    if isinstance(cache, QuantBlockKV):
        if not cache.decode_kernel:
            return None
        (km, kb, _, kc, ks, kmin), (vm, vb, vg, vc, vs, vmin) = cache.sources()
        return dict(pool=POOL_QUANT, k=_ptr(cache.s["rk"]), v=_ptr(cache.s["rv"]), W=cache.windows,
                    kmode=km, kbits=kb, kc=_ptr(kc), ks=_ptr(ks), km=_ptr(kmin),
                    vmode=vm, vbits=vb, vgroup=vg, vc=_ptr(vc), vs=_ptr(vs), vm=_ptr(vmin))
    if not isinstance(cache, BlockKV) or not cache.native:
        return None
    kind = {torch.float32: POOL_F32, torch.float16: POOL_F16, torch.bfloat16: POOL_BF16}.get(cache.k.dtype)
    if kind is None:
        return None
    out = dict(pool=kind, k=_ptr(cache.k), v=_ptr(cache.v))
    if kind != POOL_F32:
        (km, kb, _, kc, _, _), (vm, vb, vg, vc, _, _) = cache.sources()
        out |= dict(kmode=km, kbits=kb, kc=_ptr(kc), vmode=vm, vbits=vb, vgroup=vg, vc=_ptr(vc))
    return out


class FusedDecoder:
    """Every layer of one model over one pool, described once; ``run`` does a decode step's layers."""

    def __init__(self, layers: list[Layer], caches: list, rope, tensors: list[torch.Tensor]):
        self.n = len(layers)
        self.layers = (Layer * self.n)(*layers)
        self.caches = caches
        self.quant = isinstance(caches[0], QuantBlockKV)
        # blocks that leave the window are stored inside the call (qb_kv_store) where every layer's layout allows
        self.store_inside = self.quant and all(c.native_store for c in caches)
        self.cos, self.sin = rope.cos, rope.sin
        self._keep = tensors  # what the descriptions point into
        self.scratch_floats = kernels.load().qb_decode_scratch(self.layers, self.n)

    @classmethod
    def build(cls, blocks, caches) -> "FusedDecoder | None":
        """None when some layer or cache is outside what the native step takes."""
        if not kernels.available() or caches is None or len(caches) != len(blocks):
            return None
        layers, keep = [], []
        for block, cache in zip(blocks, caches):
            spec = getattr(block, "fused_spec", lambda: None)()
            pool = _pool_fields(cache)
            if spec is None or pool is None or spec["nh"] // spec["nkv"] > ops.MAX_GROUP:
                return None
            lins = {name: linear_desc(spec[name]) for name in ("qkv", "o", "gate_up", "down")}
            if any(d is None for d in lins.values()):
                return None
            keep += [spec["norm_in"], spec["norm_post"]]
            layers.append(Layer(H=spec["H"], nh=spec["nh"], nkv=spec["nkv"], hd=spec["hd"], I=spec["I"],
                                window=spec["window"] or 0, eps=spec["eps"], scale=spec["scale"],
                                norm_in=_ptr(spec["norm_in"]), norm_post=_ptr(spec["norm_post"]), **lins, **pool))
        return cls(layers, list(caches), blocks[0].rope, keep)

    def run(self, x: torch.Tensor, meta) -> torch.Tensor | None:
        """x (B, 1, H) -> the hidden states after every layer (B, 1, H); None (nothing done) when this step is
        not a decode step the native path takes."""
        if not (x.shape[1] == 1 and x.dtype == torch.float32 and meta.query_valid is None
                and meta.valid_index is None):
            return None
        plan = self.caches[0].decode_plan(meta) if self.quant else None
        if self.quant and plan is None:
            return None
        lib = kernels.load()
        B = x.shape[0]
        x = x.contiguous().clone()
        nt = torch.get_num_threads()
        scratch = torch.empty(B * self.scratch_floats, dtype=torch.float32)
        slots = plan[0] if self.quant else meta.slot_mapping
        tables, pos = meta.block_tables.contiguous(), meta.positions.contiguous()  # pos: RoPE's
        kvpos = meta.kv_positions.contiguous()  # attention's: the cache index, after eviction
        ctx, kv_slots = meta.context_lens.contiguous(), meta.kv_slots.contiguous()
        leaving = plan[1] if self.quant else None
        inside = leaving is not None and self.store_inside
        if inside:
            ring, blocks = (t.contiguous() for t in leaving)
        step = Step(B, meta.block_size, tables.shape[1], pos.data_ptr(), slots.contiguous().data_ptr(),
                    tables.data_ptr(), ctx.data_ptr(), kv_slots.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(),
                    kvpos.data_ptr(), ring.numel() if inside else 0, ring.data_ptr() if inside else 0,
                    blocks.data_ptr() if inside else 0)
        args = (ctypes.byref(step), x.data_ptr(), scratch.data_ptr())
        if leaving is None or inside:  # all layers at once, leaving blocks stored between write and attention
            lib.qb_decode_layers(self.layers, self.n, *args, STAGE_WRITE | STAGE_REST, nt)
            return x
        for i, cache in enumerate(self.caches):  # FP8 blocks leave the window: stored by torch, layer by layer
            layer = ctypes.byref(self.layers, i * ctypes.sizeof(Layer))
            lib.qb_decode_layers(layer, 1, *args, STAGE_WRITE, nt)
            cache.store_leaving(leaving)
            lib.qb_decode_layers(layer, 1, *args, STAGE_REST, nt)
        return x
