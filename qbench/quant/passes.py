"""The two passes of the block-by-block calibration (``apply.quantize_model``): a capture pass that records what a
block's linears read, and the block forward that, once the block is quantized, gives the next block its input."""

from __future__ import annotations

import torch

from qbench.layers.attention import AttnMetadata, build_mask
from qbench.quant import gptq


CHUNK_TOKENS = 512  # calibration tokens a pass runs at once (whole windows, at least one); see ``windows``


def windows(cfg, x: torch.Tensor, chunk_tokens: int | None = None):
    """x (S, T, H) in runs of whole windows of at most ``chunk_tokens`` tokens (at least one window), as
    (x, mask, metadata) for the block. A pass's float64 temporaries are then one window's (SmolLM2's gate_up
    output: 12 MiB for 512 tokens, 400 MiB for all 16,384), which the heap reuses from window to window instead
    of mapping and zeroing them afresh for each operation (heap.calibration_heap). Windows are independent, so
    every row of every product is the same computation as over all windows at once (tests hold it to the bit)."""
    chunk_tokens = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    S, T, _ = x.shape
    step = min(S, max(1, chunk_tokens // T))
    meta = AttnMetadata(positions=torch.arange(T).expand(step, T))
    mask = build_mask(meta, cfg.num_heads // cfg.num_kv_heads, cfg.sliding_window)  # (step, 1, T * g, T)
    for i in range(0, S, step):
        n = min(step, S - i)
        yield x[i: i + n], mask[:n], AttnMetadata(positions=meta.positions[:n])


def block_forward(cfg, block, x: torch.Tensor) -> torch.Tensor:
    """One block on the cache-free path: x (S, T, H) -> (S, T, H)."""
    outs = [block(xc, mask, meta, None) for xc, mask, meta in windows(cfg, x)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


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
    captured: it is the last linear of every family's block, and its product is never used. The forward runs a
    run of windows at a time; each linear's inputs are joined before anything is computed from them, so the
    Hessian, the subsample and the maxima are those of one pass over all windows."""
    seen: dict[str, list[torch.Tensor]] = {}  # in the order the forward reaches them, as the subsamples draw
    hooks = []

    def hook(name):
        def fn(mod, args):
            xin = args[0].reshape(-1, args[0].shape[-1]).double()  # the calibration's precision (wide.py)
            seen.setdefault(name, []).append(xin)
            if name == "down_proj":
                raise _Captured
        return fn

    for n in names:
        hooks.append(block.get_submodule(n).register_forward_pre_hook(hook(n)))
    try:
        for xc, mask, meta in windows(cfg, x):
            try:
                block(xc, mask, meta, None)
            except _Captured:
                pass
    finally:
        for h in hooks:
            h.remove()
    store: dict = {}
    g = torch.Generator().manual_seed(0)
    for name in list(seen):
        parts = seen.pop(name)
        xin = parts[0] if len(parts) == 1 else torch.cat(parts)  # (tokens, K)
        del parts
        if hessian:
            store["H:" + name], store["n:" + name] = gptq.hessian_add(None, xin, 0)
        keep = xin if xin.shape[0] <= max_tokens else xin[torch.randperm(xin.shape[0], generator=g)[:max_tokens]]
        store[name] = keep.clone()
        if maxima:  # every token's per-channel max |x| (under "max:name"), for SmoothQuant
            store["max:" + name] = xin.abs().amax(0)
    return store
