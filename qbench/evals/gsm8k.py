"""GSM8K in both of lm-eval's formats, greedy, scored with lm-eval's filters and exact-match rules.

- ``gsm8k``: "Question: ...\\nAnswer:" with 5 exemplars (full worked answers ending in "#### N") drawn
  from train with the suite seed, stop at "Question:"; strict-match takes "#### N".
- ``gsm8k_cot``: "Q: ...\\nA:" with the 8 fixed chain-of-thought exemplars of lm-eval's gsm8k-cot.yaml
  (shipped in evals/data/reference), stop at "Q:"; strict-match takes "The answer is N."
Both: flexible-extract takes the last number-like string; exact match ignores case, commas, "$",
everything up to "#### " and a final period, on both the answer and the target.

``chat: true`` renders either format as lm-eval's ``--apply_chat_template --fewshot_as_multiturn`` does
for an instruct model: each exemplar a user turn (the question line) and an assistant turn (its
answer), then the item as the last user turn, through the model's own chat template with the
generation prompt. Extraction and scoring are unchanged.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from types import SimpleNamespace

import yaml
from tqdm import tqdm

from qbench.engine.sampling import SamplingParams
from qbench.errors import QBenchError
from qbench.evals.subject import prefix_cache_use
from qbench.evals.data import load_jsonl, resolve
from qbench.evals.stats import mcnemar_exact, paired_bootstrap, wilson

FORMATS = {
    "gsm8k": {"text": "Question: {q}\nAnswer:", "strict": r"#### (\-?[0-9\.\,]+)",
              "stop": ("Question:", "</s>", "<|im_end|>")},
    "gsm8k_cot": {"text": "Q: {q}\nA:", "strict": r"The answer is (\-?[0-9\.\,]+).",
                  "stop": ("Q:", "</s>", "<|im_end|>")},
}
FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")
COT_EXEMPLARS = "evals/data/reference/gsm8k-cot.yaml"


@dataclass(frozen=True)
class Config:
    data: str = "evals/data/gsm8k/test.jsonl"
    train_data: str = "evals/data/gsm8k/train.jsonl"
    format: str = "gsm8k"
    limit: int = 0  # a seeded subset of this many items; 0: all
    fewshot: int = 5
    max_new_tokens: int = 256
    chat: bool = False  # lm-eval's --apply_chat_template --fewshot_as_multiturn

    def validate(self):
        if self.format not in FORMATS:
            raise ValueError(f"format: {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {self.max_new_tokens} must be >= 1")


@dataclass(frozen=True)
class CotConfig(Config):
    format: str = "gsm8k_cot"
    fewshot: int = 8


def regex_filter(text: str, pattern: str, group_select: int = 0, fallback: str = "[invalid]") -> str:
    """lm-eval's RegexFilter followed by take_first."""
    found = re.findall(pattern, text)
    if not found:
        return fallback
    m = found[group_select]
    if isinstance(m, tuple):
        m = [x for x in m if x]
        m = m[0] if m else fallback
    return m.strip()


def normalize(s: str) -> str:
    for pat in IGNORE:
        s = re.sub(pat, "", s)
    return s.lower()


def target_of(row: dict) -> str:
    return row["answer"].split("####")[-1].strip() if "answer" in row else str(row["target"])


def cot_exemplars() -> list[dict]:
    path = resolve(COT_EXEMPLARS)
    return yaml.safe_load(path.read_text())["fewshot_config"]["samples"]


def build_prompt(cfg: Config, row: dict, shots: list[dict], chat_template=None) -> str:
    """The prompt text: plain few-shot text, or (``cfg.chat``) the multi-turn chat rendered by ``chat_template``
    (a callable: messages -> text with the generation prompt)."""
    fmt = FORMATS[cfg.format]["text"]
    answer = "answer" if cfg.format == "gsm8k" else "target"
    if cfg.chat:
        if chat_template is None:
            raise ValueError("chat: true needs the model's chat template")
        messages = []
        for s in shots:
            messages += [{"role": "user", "content": fmt.format(q=s["question"])},
                         {"role": "assistant", "content": s[answer]}]
        return chat_template(messages + [{"role": "user", "content": fmt.format(q=row["question"])}])
    parts = [fmt.format(q=s["question"]) + " " + s[answer] for s in shots]
    return "\n\n".join(parts + [fmt.format(q=row["question"])])


def chat_renderer(tokenizer):
    """messages -> text, as lm-eval's HFLM.apply_chat_template renders a generation request."""
    if not getattr(tokenizer, "chat_template", None):
        raise QBenchError("gsm8k: chat: true, but the model's tokenizer has no chat template; set chat: false")
    return lambda messages: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def select(n: int, limit: int, seed: int) -> list[int]:
    if not limit or limit >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), limit))


def score(output: str, target: str, fmt: str) -> dict:
    strict = regex_filter(output, FORMATS[fmt]["strict"])
    flexible = regex_filter(output, FLEXIBLE, group_select=-1)
    gold = normalize(target)
    return {"strict": strict, "flexible": flexible, "strict_correct": normalize(strict) == gold,
            "flexible_correct": normalize(flexible) == gold}


def requests(cfg: Config, where: str, seed: int, limit: int | None = None, tokenizer=None
             ) -> tuple[list[dict], list[tuple[int, str]], SamplingParams]:
    """The eval's requests: the test rows, each chosen item's (index, prompt) in order, and the sampling.
    CoT uses the fixed exemplars; plain GSM8K draws its shots per item from train, seeded. The chat
    format renders through ``tokenizer``'s chat template."""
    render = chat_renderer(tokenizer) if cfg.chat else None
    rows = load_jsonl(cfg.data, f"{where}.data", required=("question",))
    chosen = select(len(rows), cfg.limit if limit is None else limit, seed)
    if cfg.format == "gsm8k_cot":
        fixed = cot_exemplars()[: cfg.fewshot]
        shots = lambda i: fixed  # noqa: E731
    else:
        train = load_jsonl(cfg.train_data, f"{where}.train_data", required=("question", "answer"))
        shots = lambda i: random.Random(seed * 1_000_003 + i).sample(train, cfg.fewshot)  # noqa: E731
    params = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens, stop=FORMATS[cfg.format]["stop"])
    return rows, [(i, build_prompt(cfg, rows[i], shots(i), render)) for i in chosen], params


def run(subject, cfg: Config, ctx) -> dict:
    task = cfg.format
    rows, prompts, params = requests(cfg, f"{ctx.suite_path}: tasks.{task}", ctx.seed, tokenizer=subject.tokenizer)
    chosen = [i for i, _ in prompts]
    done = ctx.store.load_items(task)
    todo = [(f"item_{i:05d}", i, p) for i, p in prompts if f"item_{i:05d}" not in done]
    counters = subject.prefill_counters()
    t0, gen_tokens = time.perf_counter(), 0
    bar = tqdm(total=len(chosen), initial=len(chosen) - len(todo), desc=task, unit="item", leave=False)
    for s in range(0, len(todo), subject.generate_chunk):
        group = todo[s: s + subject.generate_chunk]
        seqs = subject.generate([subject.encode(p) for _, _, p in group], params)
        for (key, i, prompt), seq in zip(group, seqs):
            out = seq.text.strip() if seq.finish_reason == "stop" else seq.text
            rec = {"key": key, "index": i, "prompt": prompt, "output": out, "target": target_of(rows[i]),
                   "finish_reason": seq.finish_reason, "generated_tokens": len(seq.output_ids),
                   **score(seq.text, target_of(rows[i]), task)}
            gen_tokens += len(seq.output_ids)
            ctx.store.add_item(task, rec)
            done[key] = rec
            bar.update(1)
    bar.close()
    dt = time.perf_counter() - t0
    items = [done[f"item_{i:05d}"] for i in chosen]
    out = {"items": len(items), "format": task, "fewshot": cfg.fewshot,
           "prompt_format": "chat template, few-shot as multi-turn" if cfg.chat else "plain text",
           "throughput": {"seconds": dt, "items_per_s": len(todo) / dt if todo else None,
                          "generated_tokens_per_s": gen_tokens / dt if todo else None,
                          **prefix_cache_use(counters, subject.prefill_counters())}}
    for m in ("strict", "flexible"):
        k = sum(r[f"{m}_correct"] for r in items)
        lo, hi = wilson(k, len(items))
        out[m] = {"accuracy": k / len(items), "correct": k, "ci95": [lo, hi]}
    out["score"] = out["strict"]["accuracy"]
    if ctx.base_store is not None:
        base = ctx.base_store.load_items(task)
        missing = [r["key"] for r in items if r["key"] not in base]
        if missing:
            out["vs_baseline"] = {"error": f"the baseline lacks {len(missing)} of these items"}
        else:
            out["vs_baseline"] = {}
            for m in ("strict", "flexible"):
                b = [base[r["key"]][f"{m}_correct"] for r in items]
                c = [r[f"{m}_correct"] for r in items]
                out["vs_baseline"][m] = {"mcnemar": mcnemar_exact(b, c),
                                         "diff_ci": paired_bootstrap(b, c, ctx.seed)}
            out["vs_baseline"]["same_prompts"] = all(base[r["key"]]["prompt"] == r["prompt"] for r in items)
    return out


TASK = SimpleNamespace(Config=Config, run=run)
COT_TASK = SimpleNamespace(Config=CotConfig, run=run)
