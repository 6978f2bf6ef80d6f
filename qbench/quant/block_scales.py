"""The scales a calibration folds into one block before its linears are quantized (``apply.quantize_model``):
AWQ's activation-aware scales and its clipping search, and SmoothQuant's migration scales, each searched on the
block's captured inputs and recorded in the result's layer records."""

from __future__ import annotations

import torch

from qbench.quant import awq, smoothing
from qbench.quant.recipe import Recipe


def awq_block(model, block, bi: int, inputs: dict, recipe: Recipe, res) -> None:
    """Search and fold AWQ scales for one Llama block; updates the captured inputs to match."""
    ws = recipe.weights
    for smooth, balance, xname in smoothing.mappings(model.config):
        if xname not in inputs:
            continue
        X = inputs[xname]
        W = torch.cat([block.get_submodule(b).weight for b in balance])
        bits, group, sym, _ = ws.linear_scheme(f"blocks.{bi}.{balance[0]}")  # one fused linear per mapping
        s, rec = awq.search_scales(X, W, bits, group, sym, recipe.awq.grid)
        rec.update({"block": bi, "smooth": smooth, "balance": balance})
        res.layers.append({"module": f"blocks.{bi}.{balance[0]}", "awq": rec})
        fold(block, smooth, balance, s, inputs, xname)


def awq_clip_block(block, bi: int, names: list[str], inputs: dict, recipe: Recipe, res) -> dict:
    """AWQ's clipping search for each linear of one block, after its scales are folded, as llm-awq runs it:
    the clip values (N, ngroups) per linear name. q and k are left unclipped (llm-awq skips them: their
    rounding reaches the attention scores, which a group's output MSE does not see), so a fused qkv is
    searched on its v rows only."""
    ws = recipe.weights
    out = {}
    for name in names:
        bits, group, sym, _ = ws.linear_scheme(f"blocks.{bi}.{name}")
        group = group if bits == 4 else None
        W = block.get_submodule(name).weight
        rows = slice(0, W.shape[0])
        if name == "qkv":
            rows = slice((block.nh + block.nkv) * block.hd, W.shape[0])
        clip, rec = awq.search_clip(inputs[name], W[rows], bits, group, sym, recipe.awq.grid)
        full = torch.full((W.shape[0], clip.shape[1]), float("inf"), dtype=clip.dtype)
        full[rows] = clip
        out[name] = full
        res.layers.append({"module": f"blocks.{bi}.{name}", "awq_clip": dict(rec, rows=[rows.start, rows.stop])})
    return out


def smoothquant_block(model, block, bi: int, inputs: dict, recipe: Recipe, res) -> None:
    """SmoothQuant's scales for one Llama block, from every calibration token's per-channel max |x|, with the
    recipe's alpha or the best one of ``smoothing.ALPHA_GRID`` per mapping; folded as AWQ's are."""
    ws, sq, cfg = recipe.weights, recipe.smoothquant, model.config
    for smooth, balance, xname in smoothing.mappings(cfg, shared_v=True):
        if xname not in inputs:
            continue
        name = f"blocks.{bi}.{balance[0]}"
        if ws.linear_activations(name) != "int8" or ws.linear_hadamard(name):
            continue  # smoothing serves int8 inputs; it would only cost the weights of a linear that meets fp32
            # (or whose inputs the Hadamard rotation flattens instead)
        X, x_max = inputs[xname], inputs["max:" + xname]
        W = torch.cat([block.get_submodule(b).weight for b in balance])
        tie = (lambda t: smoothing.tie_groups(t, cfg.num_kv_heads, cfg.head_dim)) if smooth == "v" else None
        rec = {"block": bi, "smooth": smooth, "balance": balance, "alpha": sq.alpha}
        if sq.search:
            bits, group, sym, _ = ws.linear_scheme(name)
            _, found = smoothing.search_alpha(X, x_max, W, bits, group, sym, tie=tie)
            rec.update(found)
        s = smoothing.smoothquant_scales(x_max, W, rec["alpha"], tie)
        rec["outlier_ratio_before"] = (x_max.max() / x_max.median().clamp(min=1e-8)).item()  # max / median of
        rec["outlier_ratio_after"] = ((x_max / s).max() / (x_max / s).median().clamp(min=1e-8)).item()  # max|x_j|
        res.layers.append({"module": f"blocks.{bi}.{balance[0]}", "smoothquant": rec})
        fold(block, smooth, balance, s, inputs, xname)


def fold(block, smooth: str, balance: list[str], s: torch.Tensor, inputs: dict, xname: str) -> None:
    """Fold s into the block and update the captured inputs to match: the balance layers now see x / s."""
    smoothing.fold(block, smooth, balance, s)
    inputs[xname] = inputs[xname] / s
    if "max:" + xname in inputs:
        inputs["max:" + xname] = inputs["max:" + xname] / s
    if "H:" + xname in inputs:
        inputs["H:" + xname] = inputs["H:" + xname] / torch.outer(s, s)
