"""Perplexity on WikiText-2 raw test, two ways.

- llama.cpp style: chunks of ``ctx`` tokens, the second half of each scored, PPL ± SE.
- lm-eval style (its ``wikitext`` task): each article detokenized and scored with disjoint rolling
  windows of ``rolling_len`` tokens (the first window starts from the prefix token), then word
  perplexity, byte perplexity and bits per byte, with words and bytes counted on the raw article.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from qbench.evals.chunks import cat, chunk_windows, namespace, ppl_se, score_chunks
from qbench.evals.data import load_text
from qbench.evals.stats import paired_bootstrap


@dataclass(frozen=True)
class Config:
    data: str = "evals/data/wikitext-2-raw/wiki.test.raw"
    ctx: int = 512
    chunks: int = 8  # 0: every chunk
    rolling_docs: int = 4  # articles for the lm-eval-style rolling perplexity; 0: all of them
    rolling_len: int = 2048
    top_k: int = 256  # top_k and exact_chunks only let a kld task over the same chunks share the records
    exact_chunks: int = 1

    def validate(self):
        if self.ctx < 4 or self.ctx % 2:
            raise ValueError(f"ctx: {self.ctx} must be an even number >= 4")
        if self.rolling_len < 2:
            raise ValueError(f"rolling_len: {self.rolling_len} must be >= 2")


ARTICLE = re.compile(r"^ = [^=].* = $", re.M)


def articles(text: str) -> list[str]:
    """Split WikiText raw into articles at top-level headings (`` = Title = ``), as the document-level
    version of the data set does."""
    starts = [m.start() for m in ARTICLE.finditer(text)]
    if not starts:
        return [text] if text.strip() else []
    bounds = starts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if text[a:b].strip()]


# lm-eval's wikitext detokenizer (from Megatron): undo the data set's tokenization spacing.
_PLAIN = [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "),
          (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", ")]
_BRACKETS = [(r"\(\s*([^\)]*?)\s*\)", r"(\1)"), (r"\[\s*([^\]]*?)\s*\]", r"[\1]"), (r"{\s*([^}]*?)\s*}", r"{\1}"),
             (r"\"\s*([^\"]*?)\s*\"", r'"\1"'), (r"'\s*([^']*?)\s*'", r"'\1'")]
_MISC = [("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"), (" \n", "\n"),
         ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")]


def detokenize(s: str) -> str:
    s = s.replace("s '", "s'")  # possessives, before the quote-pair rule below
    s = re.sub(r"/' [0-9]/", r"/'[0-9]/", s)
    for a, b in _PLAIN:
        s = s.replace(a, b)
    for pat, rep in _BRACKETS:
        s = re.sub(pat, rep, s)
    for a, b in _MISC:
        s = s.replace(a, b)
    return s


def rolling_windows(tokens: list[int], prefix: int, max_len: int) -> list[tuple[list[int], int]]:
    """Disjoint windows covering every token once -> (window input, how many of its last targets count).

    The first window is [prefix] + tokens[:max_len-1] predicting tokens[:max_len]; each later one takes
    the max_len tokens before its end and scores only its new tokens (lm-eval, context_len=1)."""
    out = []
    n = min(max_len, len(tokens))
    out.append(([prefix] + tokens[: n - 1], n))
    done = n
    while done < len(tokens):
        k = min(len(tokens) - done, max_len)
        end = done + k
        start = max(end - max_len - 1, 0)
        out.append((tokens[start: end - 1], k))
        done = end
    return out


def run(subject, cfg: Config, ctx) -> dict:
    t0 = time.perf_counter()
    text = load_text(cfg.data, f"{ctx.suite_path}: tasks.perplexity.data")
    windows = chunk_windows(subject.encode(text), cfg.ctx, cfg.chunks)
    ns = namespace(cfg.data, cfg.ctx, cfg.top_k)
    recs = score_chunks(subject, windows, cfg.top_k, ctx.store, ns, ctx.base_store, desc="perplexity",
                        exact_chunks=cfg.exact_chunks)
    nll = cat(recs, "nll")
    out = {"llama_cpp": dict(ppl_se(nll), chunks=len(windows), ctx=cfg.ctx)}
    ev = subject.eviction
    if ev is not None and ev.tokens(cfg.rolling_len) < cfg.rolling_len:  # lm-eval scores whole windows: no prompt
        out["lm_eval_rolling"] = {"skipped": "lm-eval's rolling windows score every token from the first, so "
                                             "there is no prompt for KV eviction to compress; see llama_cpp"}
        return _finish(out, ctx, recs, nll, [], time.perf_counter() - t0, len(windows))
    docs = articles(text)
    if cfg.rolling_docs:
        docs = docs[: cfg.rolling_docs]
    done = ctx.store.load_items("perplexity")
    for i, doc in enumerate(tqdm(docs, desc="rolling", unit="doc", leave=False)):
        key = f"doc_{i:05d}"
        if key in done:
            continue
        rec = {"key": key, "nll": rolling_sum(subject, detokenize(doc), cfg.rolling_len),
               "words": len(re.split(r"\s+", doc)), "bytes": len(doc.encode("utf-8"))}
        ctx.store.add_item("perplexity", rec)
        done[key] = rec
    items = [done[f"doc_{i:05d}"] for i in range(len(docs))]
    total, words, nbytes = (sum(r[k] for r in items) for k in ("nll", "words", "bytes"))
    out["lm_eval_rolling"] = {"documents": len(items), "word_perplexity": math.exp(total / words),
                              "byte_perplexity": math.exp(total / nbytes), "bits_per_byte": total / nbytes / math.log(2)}
    return _finish(out, ctx, recs, nll, items, time.perf_counter() - t0, len(windows))


def _finish(out: dict, ctx, recs: list[dict], nll: torch.Tensor, items: list[dict], dt: float, windows: int) -> dict:
    out["throughput"] = {"seconds": dt, "items_per_s": (windows + len(items)) / dt}
    out["score"] = out["llama_cpp"]["ppl"]
    if ctx.base_store is not None:
        bn = cat(recs, "nll_base")
        lr = (nll.double() - bn.double())
        out["vs_baseline"] = {"ln_ppl_ratio": lr.mean().item(), "ppl_ratio": math.exp(lr.mean().item()),
                              "nll_diff_ci": paired_bootstrap(bn.numpy(), nll.numpy(), ctx.seed)}
        base_items = ctx.base_store.load_items("perplexity")
        if items and all(r["key"] in base_items for r in items):
            b = [base_items[r["key"]]["nll"] for r in items]
            out["vs_baseline"]["rolling_nll_diff_ci"] = paired_bootstrap(b, [r["nll"] for r in items], ctx.seed)
    return out


def rolling_sum(subject, text: str, max_len: int) -> float:
    """Summed -log p of every token of ``text`` under lm-eval's disjoint rolling windows."""
    toks = subject.encode(text)
    if not toks:
        return 0.0
    tok = subject.tokenizer
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    wins, total, done = rolling_windows(toks, prefix, max_len), 0.0, 0
    spans = []  # the targets of each window: the next k tokens of the document
    for inp, k in wins:
        spans.append(torch.tensor(toks[done: done + k]))
        done += k
    def nll(i: int, lp: torch.Tensor) -> float:
        inp, k = wins[i]
        return -lp[len(inp) - k: len(inp)].gather(1, spans[i][:, None]).sum().item()

    for x in subject.map_logprobs([w for w, _ in wins], nll):  # summed in window order on every rank
        total += x
    return total
