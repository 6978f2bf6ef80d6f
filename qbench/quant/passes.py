"""The two passes of the block-by-block calibration (``apply.quantize_model``): a capture pass that records what a
block's linears read, and the block forward that, once the block is quantized, gives the next block its input."""

from __future__ import annotations

import torch

from qbench.layers.attention import AttnMetadata, build_mask
from qbench.quant import gptq


def block_forward(cfg, block, x: torch.Tensor) -> torch.Tensor:
    """One block on the cache-free path: x (S, T, H) -> (S, T, H)."""
    S, T, _ = x.shape
    meta = AttnMetadata(positions=torch.arange(T).expand(S, T))
    return block(x, build_mask(meta, cfg.num_heads // cfg.num_kv_heads, cfg.sliding_window), meta, None)


def progress(done: int, total: int, elapsed: float, what: str) -> str:
    """One progress line: blocks done, time so far and the time left at the rate so far."""
    left = elapsed / done * (total - done)
    return (f"  block {done}/{total} quantized ({what}), {_clock(elapsed)} elapsed, "
            + (f"about {_clock(left)} left" if done < total else "done"))


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


class _Captured(Exception):
    """Raised at the last captured linear's input: the rest of the block's forward would be thrown away."""


def capture(cfg, block, x: torch.Tensor, names: list[str], max_tokens: int, hessian: bool = True,
             maxima: bool = True) -> dict:
    """Inputs of the named linears of ``block`` on x: a token subsample for AWQ and errors, and the
    full Hessian (under "H:name") for GPTQ. The forward stops at down_proj's input when down_proj is
    captured: it is the last linear of every family's block, and its product is never used."""
    store: dict = {}
    hooks = []
    g = torch.Generator().manual_seed(0)

    def hook(name):
        def fn(mod, args):
            xin = args[0].reshape(-1, args[0].shape[-1]).double()  # the calibration's precision (wide.py)
            if hessian:
                store["H:" + name], store["n:" + name] = gptq.hessian_add(store.get("H:" + name), xin,
                                                                           store.get("n:" + name, 0))
            keep = xin if xin.shape[0] <= max_tokens else xin[torch.randperm(xin.shape[0], generator=g)[:max_tokens]]
            store[name] = keep.clone()
            if maxima:  # every token's per-channel max |x| (under "max:name"), for SmoothQuant
                amax = xin.abs().amax(0)
                store["max:" + name] = amax if "max:" + name not in store else torch.maximum(store["max:" + name], amax)
            if name == "down_proj":
                raise _Captured
        return fn

    for n in names:
        hooks.append(block.get_submodule(n).register_forward_pre_hook(hook(n)))
    try:
        block_forward(cfg, block, x)
    except _Captured:
        pass
    finally:
        for h in hooks:
            h.remove()
    return store
