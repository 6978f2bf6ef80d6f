"""The fp model's hidden states entering every block and its log-probs on a fixed set of windows, so that the
effect of quantizing one unit is measured by replaying only the blocks from that unit on.

Scoring follows llama.cpp's chunked convention (as the KLD eval): in a window of T tokens only positions
T/2 .. T-2 are scored, each predicting the next token with at least T/2 tokens of context. The KL divergence
is exact over the full vocabulary (not the eval's top-K bound).
"""

from __future__ import annotations

import torch

from qbench.quant.passes import block_forward
from qbench.engine.scoring import log_softmax


class Reference:
    """windows (S, T) through the fp ``model``: block inputs, the scored targets and their fp log-probs."""

    def __init__(self, model, windows: torch.Tensor, keep_inputs: bool = True):
        self.model, self.windows = model, windows
        S, T = windows.shape
        self.first = T // 2
        with torch.inference_mode():
            x = model.embed(windows, torch.arange(T).expand(S, T))  # (S, T, H)
            self.inputs = [x]
            for block in model.blocks:
                x = block_forward(model.config, block, x)
                if keep_inputs:  # else only whole-model replays (start 0) are possible
                    self.inputs.append(x)
            self.logp = self._logprobs(x)  # (S, T/2 - 1, V)
        self.targets = windows[:, self.first + 1:]  # (S, T/2 - 1)
        self.nll = -self.logp.gather(-1, self.targets[..., None])[..., 0]

    @property
    def tokens(self) -> int:
        return self.targets.numel()

    def _logprobs(self, x: torch.Tensor, model=None) -> torch.Tensor:
        """Hidden states after the last block (S, T, H) -> log-probs (S, T/2 - 1, V) at the scored positions."""
        model = self.model if model is None else model
        h = x[:, self.first: -1]
        return log_softmax(model.lm_head(model.final_norm(h)).float())

    def replay(self, start: int = 0, model=None) -> dict[str, torch.Tensor]:
        """The fp model as it is now (some units fake-quantized), or another ``model`` of the same architecture
        (a quantized copy), run from block ``start`` on the fp inputs of that block -> per scored token:
        KL(fp || model) and -log p of the target. Exact only when nothing before block ``start`` differs from
        the fp model, which is the caller's promise (start 0 with another model: its embedding too)."""
        model = self.model if model is None else model
        with torch.inference_mode():
            if model is self.model or start > 0:
                x = self.inputs[start]
            else:
                S, T = self.windows.shape
                x = model.embed(self.windows, torch.arange(T).expand(S, T))
            for block in model.blocks[start:]:
                x = block_forward(model.config, block, x)
            lq = self._logprobs(x, model)
            kld = (self.logp.exp() * (self.logp - lq)).sum(-1).clamp(min=0)
            nll = -lq.gather(-1, self.targets[..., None])[..., 0]
        return {"kld": kld.reshape(-1), "nll": nll.reshape(-1)}

    def nll_fp(self) -> torch.Tensor:
        return self.nll.reshape(-1)
