"""Needle retrieval, RULER-style: hide 7-digit "special magic numbers" in a haystack and ask for them.

Tasks (RULER's names): niah_single on a noise haystack (repeated filler sentences), niah_single on
the essay haystack (public-domain *Frankenstein*), niah_multikey (the asked key among distractor keys)
and niah_multivalue (one key, several values, all of which must be returned). Each cell of the grid
(context length in tokens x needle depth) is scored with RULER's string_match_all: the fraction of the
expected values that appear in the greedy answer. Depth places the (first) needle at that fraction of
the haystack; other needles go to seeded random depths.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

from tqdm import tqdm

from qbench.engine.sampling import SamplingParams
from qbench.evals.subject import prefix_cache_use
from qbench.evals.data import load_text
from qbench.evals.stats import mcnemar_exact, paired_bootstrap

KINDS = ("niah_single_noise", "niah_single_essay", "niah_multikey", "niah_multivalue")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TEMPLATE = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will "
            "quiz you about the numbers afterwards.\n{context}\nWhat {be} the special magic {noun} for {key} "
            "mentioned in the provided text? The special magic {noun} for {key} mentioned in the provided text {be}")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
KEYS = ("amber-falcon", "quiet-harbor", "silver-orchard", "copper-lantern", "velvet-summit", "hollow-meadow",
        "crimson-ferry", "ivory-compass", "distant-glacier", "golden-thicket", "rusty-anchor", "misty-canyon")


@dataclass(frozen=True)
class Config:
    haystack: str = "evals/data/haystack/frankenstein_pg84.txt"
    kinds: tuple = KINDS
    lengths: tuple = (1024, 2048, 4096, 8000)
    depths: tuple = (0, 25, 50, 75, 100)
    samples: int = 1  # items per (kind, length, depth) cell
    distractors: int = 3  # other keys in niah_multikey
    values: int = 3  # values of the one key in niah_multivalue
    max_new_tokens: int = 40

    def validate(self):
        for k in self.kinds:
            if k not in KINDS:
                raise ValueError(f"kinds: {k!r} is not one of {', '.join(KINDS)}")
        if not self.lengths or any(not isinstance(x, int) or x < 64 for x in self.lengths):
            raise ValueError(f"lengths: {list(self.lengths)} must be integers >= 64 (tokens)")
        if not self.depths or any(not isinstance(x, (int, float)) or not 0 <= x <= 100 for x in self.depths):
            raise ValueError(f"depths: {list(self.depths)} must be percentages from 0 to 100")
        if self.samples < 1:
            raise ValueError(f"samples: {self.samples} must be >= 1")


def essay_sentences(text: str) -> list[str]:
    """The book between Project Gutenberg's START and END markers, as sentences, without the producers'
    credits and the closing line (the PG licence lets the text be used freely once PG is not named)."""
    a, b = text.find("*** START"), text.find("*** END")
    if a >= 0 and b > a:
        text = text[text.index("\n", a) + 1: b]
    start = text.find("Letter 1", text.find("Letter 1") + 1)  # the book's first letter, after the contents
    end = text.find("End of the Project Gutenberg")
    text = text[max(start, 0): end if end > 0 else len(text)]
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?]) ", text) if s]


def build_item(kind: str, length: int, depth: float, rng: random.Random, essay: list[str], count, cfg: Config,
               start: int | None = None) -> dict:
    """One prompt of about ``length`` tokens (measured with ``count``) and its expected values. The
    haystack begins at sentence ``start`` of the essay (default: drawn from ``rng``)."""
    keys = rng.sample(KEYS, 1 + (cfg.distractors if kind == "niah_multikey" else 0))
    key = keys[0]
    nvals = cfg.values if kind == "niah_multivalue" else 1
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(nvals)]
    needles = [(NEEDLE.format(key=key, value=v), key) for v in values]
    if kind == "niah_multikey":
        needles += [(NEEDLE.format(key=k, value=rng.randint(1_000_000, 9_999_999)), k) for k in keys[1:]]
    noun, be = ("numbers", "are") if nvals > 1 else ("number", "is")
    shell = TEMPLATE.format(context="", key=key, noun=noun, be=be)
    budget = length - count(shell) - sum(count(n) for n, _ in needles)
    filler = []
    if kind == "niah_single_noise":
        unit = NOISE.strip().split(". ")
        src = [s if s.endswith(".") else s + "." for s in unit]
    else:
        start = rng.randrange(len(essay)) if start is None else start
        src = essay[start:] + essay[:start]
    used, i = 0, 0
    while True:
        s = src[i % len(src)]
        c = count(s)
        if used + c > budget:
            break
        filler.append(s)
        used += c
        i += 1
    # the first needle at the cell's depth, the rest at seeded random depths
    positions = [round(depth / 100 * len(filler))] + [rng.randint(0, len(filler)) for _ in needles[1:]]
    for (text, _), pos in sorted(zip(needles, positions), key=lambda t: -t[1]):
        filler.insert(pos, text)
    prompt = TEMPLATE.format(context=" ".join(filler), key=key, noun=noun, be=be)
    needle_texts = {t for t, _ in needles}
    while count(prompt, False) > length:  # sentence counts are nearly additive; trim the excess
        last = max(i for i, t in enumerate(filler) if t not in needle_texts)
        filler.pop(last)
        prompt = TEMPLATE.format(context=" ".join(filler), key=key, noun=noun, be=be)
    return {"prompt": prompt, "expected": values, "key": key}


def string_match_all(output: str, expected: list[str]) -> float:
    return sum(v.lower() in output.lower() for v in expected) / len(expected)


def heatmap(path, kind: str, lengths, depths, grid) -> None:
    from qbench.evals.plots import pyplot, save
    fig, ax = pyplot().subplots(figsize=(1.2 + 0.9 * len(lengths), 1 + 0.5 * len(depths)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(kind)
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.05)
    save(fig, path)


def run(subject, cfg: Config, ctx) -> dict:
    window = subject.engine.config.max_positions
    too_long = [x for x in cfg.lengths if x + cfg.max_new_tokens >= window]
    if too_long:
        from qbench.errors import QBenchError
        raise QBenchError(f"{ctx.suite_path}: tasks.needle.lengths: {too_long} plus max_new_tokens exceed the "
                          f"model's context window of {window}")
    essay = essay_sentences(load_text(cfg.haystack, f"{ctx.suite_path}: tasks.needle.haystack"))
    memo: dict[str, int] = {}

    def count(s: str, memo_it: bool = True) -> int:
        if not memo_it:
            return len(subject.encode(s))
        if s not in memo:
            memo[s] = len(subject.encode(s))
        return memo[s]

    cells = [(k, n, d, s) for k in cfg.kinds for n in cfg.lengths for d in cfg.depths for s in range(cfg.samples)]
    done = ctx.store.load_items("needle")
    todo = []
    for k, n, d, s in cells:
        key = f"{k}-{n}-{d:g}-{s}"
        if key not in done:
            rng = random.Random(f"{ctx.seed}-{key}")
            # one haystack per (kind, sample), as RULER's essay haystack: prompts of every length and depth
            # share the text before their first needle, and the engine's prefix cache computes it once
            start = random.Random(f"{ctx.seed}-{k}-{s}").randrange(len(essay))
            todo.append((key, k, n, d, build_item(k, n, d, rng, essay, count, cfg, start)))
    counters = subject.prefill_counters()
    t0, prompt_tokens = time.perf_counter(), 0
    params = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens)
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc="needle", unit="item", leave=False)
    todo.sort(key=lambda t: t[2])  # similar lengths batch together
    for i in range(0, len(todo), subject.batch_size):
        group = todo[i: i + subject.batch_size]
        ids = [subject.encode(item["prompt"]) for *_, item in group]
        for (key, k, n, d, item), p, seq in zip(group, ids, subject.generate(ids, params)):
            rec = {"key": key, "kind": k, "length": n, "depth": d, "prompt_tokens": len(p), "expected": item["expected"],
                   "output": seq.text, "score": string_match_all(seq.text, item["expected"])}
            prompt_tokens += len(p)
            ctx.store.add_item("needle", rec)
            done[key] = rec
            bar.update(1)
    bar.close()
    dt = time.perf_counter() - t0
    items = [done[f"{k}-{n}-{d:g}-{s}"] for k, n, d, s in cells]
    out = {"items": len(items), "lengths": list(cfg.lengths), "depths": list(cfg.depths), "kinds": {},
           "throughput": {"seconds": dt, "items_per_s": len(todo) / dt if todo else None,
                          "prompt_tokens_per_s": prompt_tokens / dt if todo else None,
                          **prefix_cache_use(counters, subject.prefill_counters())}}
    for kind in cfg.kinds:
        grid = [[sum(r["score"] for r in items if r["kind"] == kind and r["length"] == n and r["depth"] == d) / cfg.samples
                 for n in cfg.lengths] for d in cfg.depths]
        mine = [r for r in items if r["kind"] == kind]
        out["kinds"][kind] = {"score": sum(r["score"] for r in mine) / len(mine), "grid": grid,
                              "by_length": {str(n): sum(r["score"] for r in mine if r["length"] == n) /
                                            sum(1 for r in mine if r["length"] == n) for n in cfg.lengths}}
        if ctx.store.write:  # rank 0 of a data-parallel run
            heatmap(ctx.store.root / f"needle_{kind}.png", kind, cfg.lengths, cfg.depths, grid)
    out["score"] = sum(r["score"] for r in items) / len(items)
    out["by_length"] = {str(n): sum(r["score"] for r in items if r["length"] == n) /
                        sum(1 for r in items if r["length"] == n) for n in cfg.lengths}
    if ctx.base_store is not None:
        base = ctx.base_store.load_items("needle")
        if all(r["key"] in base for r in items):
            b, c = [base[r["key"]]["score"] for r in items], [r["score"] for r in items]
            out["vs_baseline"] = {"mcnemar": mcnemar_exact([x == 1.0 for x in b], [x == 1.0 for x in c]),
                                  "diff_ci": paired_bootstrap(b, c, ctx.seed)}
    return out
