"""Per-input-channel scales moved from a linear's input to its weights, through the op before it.

For a mapping (a smoothing op -> the linears that read its output), X W^T = (X / s)(W s)^T: the smoothing op
divides its output by s (a norm's weight, or the rows of the previous linear) and the linears multiply their
input columns by s, so the fp model is unchanged and only what the quantizers see moves. AWQ searches s for
the weights' grid (``awq``); SmoothQuant (Xiao et al., 2023) sets s = max|X|^alpha / max|W|^(1 - alpha) so
that per-token INT8 activations lose less to outlier channels, and takes part of the difficulty into the
weights. Both fold their scales here.
"""

from __future__ import annotations

import torch

from qbench.quant.primitives import fake_quantize, fake_quantize_activations

ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(11))  # 0 .. 1: every migration strength
SEARCH_TOKENS = 1024  # captured inputs (a random sample already) the search scores each alpha on


def mappings(cfg, shared_v: bool = False) -> list[tuple[str, list[str], str]]:
    """(smoothing op, linears that read its output, the captured input's name) for one Llama-family block.
    v -> o: with grouped-query attention a V row feeds one input column of o per query head of its group, so
    the scale must be shared by those columns (``shared_v``: the caller ties them, see ``tie_groups``); AWQ's
    per-column search cannot, and takes v -> o only when there are as many KV heads as query heads."""
    out = [("input_norm", ["qkv"], "qkv"), ("post_norm", ["gate_up"], "gate_up"), ("up", ["down_proj"], "down_proj")]
    if shared_v or cfg.num_kv_heads == cfg.num_heads:
        out.append(("v", ["o_proj"], "o_proj"))
    return out


def tie_groups(t: torch.Tensor, nkv: int, hd: int) -> torch.Tensor:
    """Per input column of o (nh * hd,) -> the max over the query heads that share a KV head, for each column
    of the group: the columns one V row feeds then get one scale."""
    return t.view(nkv, -1, hd).amax(1, keepdim=True).expand(nkv, t.numel() // (nkv * hd), hd).reshape(-1)


def fold(block, smooth: str, balance: list[str], s: torch.Tensor) -> None:
    """Multiply the balance linears' input columns by s (K,) and divide the smoothing op's output by s."""
    if smooth == "v":
        s_v = s.view(block.nkv, block.nh // block.nkv, block.hd)
        if not torch.equal(s_v, s_v[:, :1].expand_as(s_v)):
            raise ValueError("v -> o scales must be shared by the query heads of a KV group")
    for b in balance:
        lin = block.get_submodule(b)
        lin.set_weight(lin.weight * s)
    if smooth in ("input_norm", "post_norm"):
        norm = block.get_submodule(smooth)
        norm.weight.data = norm.weight.data / s
    elif smooth == "up":  # down's input is silu(gate) * up: up's rows (and bias) carry the division
        _divide_rows(block.gate_up, block.inter, s)
    elif smooth == "v":  # s (nh * hd,), equal over the query heads of a KV group: V row (g, d) takes s[g, 0, d]
        _divide_rows(block.qkv, (block.nh + block.nkv) * block.hd, s_v[:, 0].reshape(-1))
    else:
        raise ValueError(f"no fold for smoothing op {smooth!r}")


def _divide_rows(lin, start: int, s: torch.Tensor) -> None:
    """Rows [start, start + len(s)) of a linear's output, its bias included (Qwen2's q/k/v have one), by s."""
    W = lin.weight.clone()
    W[start:start + s.numel()] /= s[:, None]
    lin.set_weight(W)
    if getattr(lin, "bias", None) is not None:
        lin.bias.data[start:start + s.numel()] /= s


def smoothquant_scales(x_max: torch.Tensor, W: torch.Tensor, alpha: float, tie=None) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha) for each input channel j; x_max (K,), W (N, K).
    Channels that never fire (or weights that are all zero) keep s = 1. ``tie``: a function applied to both
    maxima (``tie_groups``) so that tied channels get one scale."""
    w_max = W.abs().amax(0).to(x_max.dtype)
    if tie is not None:
        x_max, w_max = tie(x_max), tie(w_max)
    s = x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    dead = (x_max <= 0) | (w_max <= 0)
    return torch.where(dead, torch.ones_like(s), s).clamp(min=1e-5)


def smoothed_error(X: torch.Tensor, W: torch.Tensor, s: torch.Tensor, bits: int, group: int | None,
                   symmetric: bool) -> float:
    """Mean squared error of the smoothed, quantized layer ((X / s) on its int8 grid against W s on its weight
    grid) against the fp layer X W^T, in X's precision."""
    W = W.to(X.dtype)
    ref = X @ W.t()
    got = fake_quantize_activations(X / s).to(X.dtype) @ fake_quantize(W * s, bits, group, symmetric).to(X.dtype).t()
    return (got - ref).pow(2).mean().item()


def search_alpha(X: torch.Tensor, x_max: torch.Tensor, W: torch.Tensor, bits: int, group: int | None,
                 symmetric: bool, grid=ALPHA_GRID, tie=None) -> tuple[float, dict]:
    """The alpha of ``grid`` whose scales give the lowest ``smoothed_error`` on the captured inputs X (T, K), at
    most ``SEARCH_TOKENS`` of them: 11 alphas on 4,096 tokens took Qwen2.5-0.5B's gate/up search to minutes
    per block, and the choice is a coarse one."""
    X = X[:SEARCH_TOKENS]
    losses = {a: smoothed_error(X, W, smoothquant_scales(x_max, W, a, tie), bits, group, symmetric) for a in grid}
    best = min(losses, key=losses.get)
    return best, {"alpha": best, "mse": losses[best], "mse_by_alpha": losses}
