"""The fp model's hidden states entering every block and its log-probs on a fixed set of windows, so that the
effect of quantizing one unit is measured by replaying only the blocks from that unit on.

Scoring follows llama.cpp's chunked convention (as the KLD eval): in a window of T tokens only positions
T/2 .. T-2 are scored, each predicting the next token with at least T/2 tokens of context. The KL divergence
is exact over the full vocabulary (not the eval's top-K bound).

The head, the log-softmax and the divergence run ROWS scored positions at a time: a replay's whole (S, T/2 - 1, V)
logits would be 620 MB on Qwen's 152k vocabulary at the default windows, and allocating, faulting in and
streaming three such temporaries per replay cost as much as the head's GEMM. Every row's figures are the same bits
either way (each row's GEMM, log-softmax and sums are its own).
"""

from __future__ import annotations

import torch

from qbench.quant.passes import block_forward
from qbench.engine.scoring import log_softmax


ROWS = 128  # scored positions per head GEMM: enough rows that the head's weights are not streamed too often


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
            self.logp = torch.cat([lp for _, lp in self._head(self._scored(x, model), model)])  # (N, V)
        self.targets = windows[:, self.first + 1:].reshape(-1)  # (N,)
        self.nll = -self.logp.gather(-1, self.targets[:, None])[:, 0]

    @property
    def tokens(self) -> int:
        return self.targets.numel()

    def _scored(self, x: torch.Tensor, model) -> torch.Tensor:
        """Hidden states after the last block (S, T, H) -> the final-normed scored positions (N, H)."""
        return model.final_norm(x[:, self.first: -1]).reshape(-1, x.shape[-1])

    @staticmethod
    def _head(h: torch.Tensor, model):
        """Scored hidden states (N, H) -> (rows, their log-probs (ROWS, V)), ROWS rows at a time."""
        for i in range(0, h.shape[0], ROWS):
            rows = slice(i, i + ROWS)
            yield rows, log_softmax(model.lm_head(h[rows]).float())

    def _compare(self, h: torch.Tensor, model) -> dict[str, torch.Tensor]:
        """Scored hidden states (N, H) through ``model``'s head -> per row KL(fp || model) and -log p(target)."""
        kld, nll = torch.empty(h.shape[0]), torch.empty(h.shape[0])
        for rows, lq in self._head(h, model):
            p = self.logp[rows]
            kld[rows] = (p.exp() * (p - lq)).sum(-1)
            nll[rows] = -lq.gather(-1, self.targets[rows, None])[:, 0]
        return {"kld": kld.clamp_(min=0), "nll": nll}

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
            return self._compare(self._scored(x, model), model)

    def nll_fp(self) -> torch.Tensor:
        return self.nll
