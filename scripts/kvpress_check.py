"""Cross-check qbench's KV eviction against NVIDIA's kvpress (PyPI ``kvpress``) on one model, the same needle
prompts and the same budget: per-layer, per-KV-head keep-sets at the end of the prefill, and needle scores.

kvpress pins transformers < 5.3, so it cannot share qbench's environment. The check runs in three steps:

    .venv/bin/python scripts/kvpress_check.py qbench MODEL_FOLDER OUT.json [LENGTHS]  # qbench: prompts, keep-sets, answers
    python3 -m venv kvp && kvp/bin/pip install torch==2.13.0 kvpress==0.5.5
    kvp/bin/python scripts/kvpress_check.py kvpress OUT.json                 # kvpress: the same, added to OUT.json
    .venv/bin/python scripts/kvpress_check.py compare OUT.json               # the table (markdown)

Both sides keep floor(n / 4) of an n-token prompt (kvpress's compression_ratio 0.75; qbench is given that
count as an integer budget) and decode greedily. Where the definitions differ, the table says how:
- SnapKV: the same rule (window 64, kernel 5, average pooling, summed over each KV group's query heads; the
  window is kept). kvpress averages over queries and heads where qbench sums: the same order.
- StreamingLLM: the same rule (4 sinks, the most recent tokens).
- Decode: kvpress compresses the prefill only; qbench evicts again once a sequence holds budget + one block
  (16 tokens), so qbench's answer tokens after the 16th read a smaller cache than kvpress's.
- Ties in the scores: qbench keeps the earlier position; kvpress keeps whatever torch.topk returns.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

POLICIES = {"snapkv": {"window": 64, "pool": 5}, "streaming": {"sinks": 4}}
RATIO = 0.75


def _needle_items(tok, lengths, depths, samples, seed=1234):
    from random import Random
    from qbench.evals.needle import Config, build_item, essay_sentences
    from qbench.evals.data import load_text
    cfg = Config(kinds=("niah_single_essay",), lengths=tuple(lengths), depths=tuple(depths), samples=samples)
    essay = essay_sentences(load_text(cfg.haystack, "needle haystack"))
    count = lambda s, memo=True: len(tok(s)["input_ids"])  # noqa: E731
    items = []
    for n in lengths:
        for d in depths:
            for s in range(samples):
                key = f"niah_single_essay-{n}-{d}-{s}"
                start = Random(f"{seed}-niah_single_essay-{s}").randrange(len(essay))
                item = build_item("niah_single_essay", n, d, Random(f"{seed}-{key}"), essay, count, cfg, start)
                items.append({"key": key, "length": n, "depth": d, "ids": tok(item["prompt"])["input_ids"],
                              "expected": item["expected"]})
    return items


def run_qbench(folder: str, out: str, lengths=(1024, 2048), depths=(10, 50, 90), samples=2, new=24) -> None:
    from transformers import AutoTokenizer

    from qbench.engine.engine import Engine
    from qbench.engine.sampling import SamplingParams
    from qbench.evals.needle import string_match_all
    from qbench.layers.kvscheme import KVScheme
    from qbench.models.registry import load_model

    tok = AutoTokenizer.from_pretrained(folder)
    model = load_model(folder)
    items = _needle_items(tok, lengths, depths, samples)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    for it in items:
        it["qbench"] = {}
        n = len(it["ids"])
        for policy, opts in POLICIES.items():
            kv = KVScheme(scheme="fp", evict=policy, budget=int(n * (1 - RATIO)), **opts)
            eng = Engine(model, max_batch=1, kv_scheme=kv)
            eng.generate([it["ids"][:8]], SamplingParams(max_new_tokens=1))  # builds the evictor
            seen = {}
            keep_set = eng.evictor.keep_set

            def spy(seq, keep_set=keep_set, seen=seen):
                k = keep_set(seq)
                if "keep" not in seen:  # the first eviction is the one at the end of the prefill
                    seen["keep"] = k.tolist()
                return k

            eng.evictor.keep_set = spy
            seq = eng.generate([it["ids"]], params)[0]
            text = tok.decode(seq.output_ids, skip_special_tokens=True)
            it["qbench"][policy] = {"keep": seen["keep"], "output": text,
                                    "score": string_match_all(text, it["expected"])}
        print(it["key"], {p: r["score"] for p, r in it["qbench"].items()}, flush=True)
    Path(out).write_text(json.dumps({"model": folder, "ratio": RATIO, "new_tokens": new, "items": items}))


def run_kvpress(path: str) -> None:
    import torch
    from kvpress import SnapKVPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    data = json.loads(Path(path).read_text())
    folder, new = data["model"], data["new_tokens"]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def recording(cls, **kw):
        class Recording(cls):
            def score(self, module, hidden_states, keys, values, attentions, kwargs):
                s = super().score(module, hidden_states, keys, values, attentions, kwargs)
                n_kept = int(keys.shape[2] * (1 - self.compression_ratio))
                self.kept[module.layer_idx] = s[0].topk(n_kept, dim=-1).indices.sort(dim=-1).values.tolist()
                return s
        press = Recording(compression_ratio=RATIO, **kw)
        press.kept = {}
        return press

    presses = {"snapkv": lambda: recording(SnapKVPress, window_size=64, kernel_size=5),
               "streaming": lambda: recording(StreamingLLMPress, n_sink=4)}
    for it in data["items"]:
        it["kvpress"] = {}
        ids = torch.tensor([it["ids"]])
        n = ids.shape[1]
        for policy, make in presses.items():
            press = make()
            cache = DynamicCache()
            with torch.no_grad():
                with press(model):
                    out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
                toks = [int(out.logits[0, -1].argmax())]
                for i in range(new - 1):  # RoPE by the true position; the cache holds fewer tokens
                    out = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache,
                                position_ids=torch.tensor([[n + i]]))
                    toks.append(int(out.logits[0, -1].argmax()))
            text = tok.decode(toks, skip_special_tokens=True)
            score = sum(v.lower() in text.lower() for v in it["expected"]) / len(it["expected"])
            it["kvpress"][policy] = {"keep": [press.kept[i] for i in sorted(press.kept)], "output": text,
                                     "score": score}
        print(it["key"], {p: r["score"] for p, r in it["kvpress"].items()}, flush=True)
    Path(path).write_text(json.dumps(data))


def compare(path: str) -> str:
    data = json.loads(Path(path).read_text())
    lines = [f"kvpress against qbench on {Path(data['model']).name}: {len(data['items'])} needle prompts, "
             f"{1 - data['ratio']:.0%} of each prompt kept, {data['new_tokens']} greedy tokens", "",
             "| policy | keep-sets identical (layer x head) | mean Jaccard | needle qbench | needle kvpress | "
             "same answer |", "|---|---|---|---|---|---|"]
    for policy in POLICIES:
        same = total = 0
        jac = []
        for it in data["items"]:
            a, b = it["qbench"][policy]["keep"], it["kvpress"][policy]["keep"]
            for la, lb in zip(a, b):
                for ha, hb in zip(la, lb):
                    sa, sb = set(ha), set(hb)
                    total += 1
                    same += sa == sb
                    jac.append(len(sa & sb) / len(sa | sb))
        qs = [it["qbench"][policy]["score"] for it in data["items"]]
        ks = [it["kvpress"][policy]["score"] for it in data["items"]]
        ans = sum(it["qbench"][policy]["output"] == it["kvpress"][policy]["output"] for it in data["items"])
        lines.append(f"| {policy} | {same}/{total} | {sum(jac) / len(jac):.4f} | {sum(qs) / len(qs):.2f} | "
                     f"{sum(ks) / len(ks):.2f} | {ans}/{len(data['items'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("qbench", "kvpress", "compare"):
        sys.exit(__doc__)
    if sys.argv[1] == "qbench":
        if len(sys.argv) not in (4, 5):
            sys.exit("usage: scripts/kvpress_check.py qbench MODEL_FOLDER OUT.json [LENGTHS, e.g. 2048,4096]")
        lengths = tuple(int(n) for n in sys.argv[4].split(",")) if len(sys.argv) == 5 else (1024, 2048)
        run_qbench(sys.argv[2], sys.argv[3], lengths)
    elif sys.argv[1] == "kvpress":
        run_kvpress(sys.argv[2])
    else:
        print(compare(sys.argv[2]))
