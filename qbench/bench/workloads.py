"""Request-stream workloads for ``qbench bench --workload``: each runs the same requests twice or more in
one process (prefix cache on and off, continuous and static batching, block sizes 8/16/32) and reports
work done, wall time and KV memory side by side. Ratios within one run are the figures to quote."""

from __future__ import annotations

import random
import statistics
import time

from qbench.bench.workload import TEXT
from qbench.engine.engine import Engine
from qbench.engine.sampling import SamplingParams
from qbench.errors import QBenchError

WORKLOADS = ("gsm8k", "agent", "mixed")


class Subject:
    """One loaded model (fp or artifact, optional KV scheme) from which engines of any shape are made."""

    def __init__(self, model: str, kv: str | None = None, dtype: str = "fp32"):
        from qbench.engine.api import Generator
        from qbench.quant.recipe import load_kv_scheme

        self.gen = Generator(model, dtype=dtype, kv_scheme=load_kv_scheme(kv) if kv else None)
        self.base = self.gen.backend
        self.tokenizer = self.gen.tokenizer

    def engine(self, block_size: int = 16, **kw) -> Engine:
        scheme = self.base.kv_scheme
        if scheme is not None:
            from dataclasses import replace
            scheme = replace(scheme, group=block_size, residual=block_size * scheme.windows)
        eng = Engine(self.base.model, block_size=block_size, kv_scheme=scheme, detokenize=self.gen.detokenize, **kw)
        eng.eos_ids = self.base.eos_ids
        return eng


class MemoryProbe:
    """Per step, KV bytes reserved (blocks held by running requests) against bytes used (tokens written),
    and the block-table entries the step passes to attention (the cost of indirection)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.steps = 0
        self.peak_reserved = self.used_at_peak = 0
        self.sum_reserved = self.sum_used = 0
        self.max_waste_tokens = 0  # over sequences and steps
        self.table_entries = 0

    def __call__(self, sched, step) -> None:
        eng, bs = self.engine, self.engine.block_size
        per_block = eng.pool.block_nbytes
        per_token = per_block / bs
        chunk = {id(s): n for s, n in step.prefills}
        reserved = used = 0
        for s in sched.running:  # tokens in the cache once this step has run
            tokens = len(s) if s.prefilled else s.num_cached + chunk.get(id(s), 0)
            blocks = len(s.block_table)
            self.max_waste_tokens = max(self.max_waste_tokens, blocks * bs - tokens)
            reserved += blocks * per_block
            used += tokens * per_token
            self.table_entries += blocks
        self.steps += 1
        self.sum_reserved += reserved
        self.sum_used += used
        if reserved > self.peak_reserved:
            self.peak_reserved, self.used_at_peak = reserved, used

    def report(self) -> dict:
        bs = self.engine.block_size
        return {"block_size": bs, "steps": self.steps, "peak_reserved_bytes": self.peak_reserved,
                "used_bytes_at_peak": round(self.used_at_peak),
                "reserved_over_used": self.sum_reserved / self.sum_used if self.sum_used else None,
                "max_waste_tokens_per_sequence": self.max_waste_tokens,
                "waste_within_one_partial_block": self.max_waste_tokens <= bs - 1,
                "block_table_entries": self.table_entries, "block_table_bytes": 8 * self.table_entries}


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]], group: int | None = None) -> dict:
    """Replays ``requests`` (in groups of ``group`` per generate call, as an eval submits them)."""
    engine.reset_stats()
    group = group or len(requests)
    t0 = time.perf_counter()
    seqs = []
    for i in range(0, len(requests), group):
        chunk = requests[i: i + group]
        seqs += engine.generate([p for p, _ in chunk], [sp for _, sp in chunk])
    wall = time.perf_counter() - t0
    st = engine.stats
    return {"wall_s": wall, "prefill_tokens_computed": st.computed_prefill_tokens,
            "prefill_tokens_from_cache": st.cached_tokens, "prefill_s": sum(st.prefill_s),
            "decode_s": sum(st.decode_s), "forward_passes": len(st.prefill_s) + len(st.decode_s),
            "preemptions": st.preemptions, "generated_tokens": sum(len(s.output_ids) for s in seqs),
            "_seqs": seqs, "_t0": t0}


def _outputs(run: dict) -> list[list[int]]:
    return [s.output_ids for s in run["_seqs"]]


def _clean(run: dict) -> dict:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def _cache_pair(subject: Subject, requests, group=None, max_batch: int = 8, **kw) -> dict:
    """The same requests without and with the prefix cache, in this order, after one warm-up."""
    off = subject.engine(max_batch=max_batch, **kw)
    on = subject.engine(max_batch=max_batch, prefix_cache=True, **kw)
    if on.prefix_cache_note:
        raise QBenchError(f"bench: {on.prefix_cache_note}")
    _run(off, requests[:1])  # warm-up: first-call allocations and kernel set-up
    a = _run(off, requests, group)
    b = _run(on, requests, group)
    computed_off, computed_on = a["prefill_tokens_computed"], b["prefill_tokens_computed"]
    return {"without_cache": _clean(a), "with_cache": _clean(b),
            "prefill_tokens_saved_fraction": 1 - computed_on / computed_off,
            "wall_ratio_without_over_with": a["wall_s"] / b["wall_s"],
            "prefill_time_ratio_without_over_with": a["prefill_s"] / b["prefill_s"],
            "identical_outputs": _outputs(a) == _outputs(b), "_runs": (a, b)}


def gsm8k(subject: Subject, suite: str, limit: int, max_new_tokens: int | None = None) -> dict:
    """The GSM8K eval's own requests: its prompts and seed, its batches, its stop strings, greedy."""
    from dataclasses import replace

    from qbench.evals import gsm8k as g
    from qbench.evals.suite import load_suite

    s = load_suite(suite)
    task = next((t for t in ("gsm8k_cot", "gsm8k") if t in s.tasks), None)
    if task is None:
        raise QBenchError(f"bench: {suite} has no gsm8k or gsm8k_cot task to replay")
    cfg = s.tasks[task]
    _, prompts, params = g.requests(cfg, f"{suite}: tasks.{task}", s.seed, limit or None, subject.tokenizer)
    if max_new_tokens:
        params = replace(params, max_new_tokens=max_new_tokens)
    requests = [(subject.tokenizer(p)["input_ids"], params) for _, p in prompts]
    pair = _cache_pair(subject, requests, group=s.batch_size, max_batch=s.batch_size)
    pair.pop("_runs")
    lens = [len(p) for p, _ in requests]
    return {"workload": "gsm8k", "task": task, "suite": suite, "items": len(requests), "batch": s.batch_size,
            "max_new_tokens": params.max_new_tokens, "prompt_tokens": sum(lens),
            "mean_prompt_tokens": sum(lens) / len(lens), **pair}


def agent(subject: Subject, steps: int = 20, gen_len: int = 16) -> dict:
    """A 20-step agent that resends its growing history each step: system prompt, then per step the
    model's reply and a tool observation. Token ids are concatenated, so every step's prompt extends
    the last one."""
    tok = subject.tokenizer
    system = tok("You are an agent that solves tasks with tools. Think briefly, call one tool per step, "
                 "and read its observation before the next call. " + TEXT[:400])["input_ids"]
    sp = SamplingParams(max_new_tokens=gen_len, ignore_eos=True)
    out = {"workload": "agent", "steps": steps, "gen_len": gen_len, "system_tokens": len(system)}
    runs = {}
    for name, cache in (("without_cache", False), ("with_cache", True)):
        eng = subject.engine(max_batch=1, prefix_cache=cache)
        if name == "without_cache":
            eng.generate([system], SamplingParams(max_new_tokens=2))  # warm-up
        history, per_step, replies = list(system), [], []
        t0 = time.perf_counter()
        for k in range(steps):
            before = eng.stats.computed_prefill_tokens
            seq = eng.generate([history], sp)[0]
            per_step.append(eng.stats.computed_prefill_tokens - before)
            obs = tok(f"\nObservation {k + 1}: the tool returned {k * 37 % 101} rows; step {k + 1} done.\n")["input_ids"]
            replies.append(seq.output_ids)
            history += seq.output_ids + obs
        wall = time.perf_counter() - t0
        runs[name] = {"wall_s": wall, "prefill_tokens_per_step": per_step, "prefill_tokens_total": sum(per_step),
                      "final_history_tokens": len(history), "_replies": replies}
    for r in runs.values():
        r.update(_growth(r["prefill_tokens_per_step"]))
    out["identical_outputs"] = runs["without_cache"].pop("_replies") == runs["with_cache"].pop("_replies")
    out.update(runs)
    out["prefill_tokens_saved_fraction"] = 1 - (runs["with_cache"]["prefill_tokens_total"]
                                                / runs["without_cache"]["prefill_tokens_total"])
    out["wall_ratio_without_over_with"] = runs["without_cache"]["wall_s"] / runs["with_cache"]["wall_s"]
    return out


def _growth(per_step: list[int]) -> dict:
    """How the total grows with the step count: a least-squares line through the per-step work. Per-step
    work that grows across the run (the line rises by more than half the mean over n steps) makes the
    total quadratic; flat per-step work makes it linear."""
    n = len(per_step)
    slope, intercept = statistics.linear_regression(list(range(1, n + 1)), per_step)
    rising = slope * n > 0.5 * statistics.fmean(per_step)
    return {"per_step_slope_tokens": slope, "per_step_intercept_tokens": intercept,
            "total_growth": "quadratic" if rising else "linear"}


def mixed(subject: Subject, requests_n: int = 32, max_batch: int = 8, token_budget: int = 1024,
          seed: int = 0, block_sizes=(8, 16, 32), max_prompt: int = 512, max_gen: int = 96) -> dict:
    """A stream of requests with mixed prompt and output lengths, all queued at t=0, under static and
    continuous batching; then continuous batching at each block size for the memory accounting."""
    rng = random.Random(seed)
    ids = subject.tokenizer(TEXT * 12)["input_ids"]
    requests = []
    for i in range(requests_n):
        plen = int(round(16 * (max_prompt / 16) ** rng.random()))  # log-uniform, 16 to max_prompt tokens
        start = rng.randrange(len(ids) - plen)
        requests.append((ids[start: start + plen], SamplingParams(max_new_tokens=rng.randint(8, max_gen), ignore_eos=True)))
    out = {"workload": "mixed", "requests": requests_n, "max_batch": max_batch, "token_budget": token_budget,
           "prompt_tokens": [len(p) for p, _ in requests], "gen_tokens": [sp.max_new_tokens for _, sp in requests]}
    runs = {}
    warm = subject.engine(max_batch=max_batch)
    _run(warm, requests[:2])
    for policy in ("static", "continuous"):
        eng = subject.engine(max_batch=max_batch, policy=policy, token_budget=token_budget)
        probe = MemoryProbe(eng)
        eng.observer = probe
        r = _run(eng, requests)
        runs[policy] = r
        out[policy] = {**_clean(r), **_latency(r), "memory": probe.report()}
    out["identical_outputs"] = _outputs(runs["static"]) == _outputs(runs["continuous"])
    out["throughput_ratio_continuous_over_static"] = (out["continuous"]["throughput_tok_s"]
                                                      / out["static"]["throughput_tok_s"])
    out["block_sizes"] = []
    for bs in block_sizes:
        eng = subject.engine(block_size=bs, max_batch=max_batch, token_budget=token_budget)
        probe = MemoryProbe(eng)
        eng.observer = probe
        r = _run(eng, requests)
        out["block_sizes"].append({**probe.report(), "wall_s": r["wall_s"], "decode_s": r["decode_s"],
                                   "identical_outputs": _outputs(r) == _outputs(runs["continuous"])})
    return out


def _latency(run: dict) -> dict:
    seqs, t0 = run["_seqs"], run["_t0"]
    done = sorted(s.t_done - t0 for s in seqs)  # every request is queued at t0
    first = sorted(s.t_first - t0 for s in seqs)

    def pct(xs, q):
        return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]

    return {"throughput_tok_s": run["generated_tokens"] / run["wall_s"],
            "latency_s": {f"p{q}": pct(done, q) for q in (50, 90, 99)},
            "ttft_s": {f"p{q}": pct(first, q) for q in (50, 90, 99)}}


def run_workload(name: str, model: str, kv: str | None = None, suite: str = "evals/full.yaml", limit: int = 8,
                 gen_len: int | None = None) -> dict:
    if name not in WORKLOADS:
        raise QBenchError(f"bench: unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    import torch

    subject = Subject(model, kv)
    if name == "gsm8k":
        rep = gsm8k(subject, suite, limit, max_new_tokens=gen_len)
    elif name == "agent":
        rep = agent(subject, gen_len=gen_len or 16)
    else:
        rep = mixed(subject)
    rep["model"], rep["kv"] = model, kv
    rep["threads"] = torch.get_num_threads()
    return rep


def render_workload(rep: dict) -> str:
    """A short plain-text summary; the JSON (--out) has everything."""
    name = rep["workload"]
    lines = [f"workload {name} on {rep['model']}" + (f" with KV {rep['kv']}" if rep.get("kv") else "")]
    if name in ("gsm8k", "agent"):
        a, b = rep["without_cache"], rep["with_cache"]
        ta, tb = (a["prefill_tokens_computed"], b["prefill_tokens_computed"]) if name == "gsm8k" else \
            (a["prefill_tokens_total"], b["prefill_tokens_total"])
        lines.append(f"  prefill tokens computed: {ta} without the prefix cache, {tb} with it "
                     f"({rep['prefill_tokens_saved_fraction']:.1%} saved)")
        lines.append(f"  wall: {a['wall_s']:.1f} s without, {b['wall_s']:.1f} s with "
                     f"({rep['wall_ratio_without_over_with']:.2f}x)")
        if name == "agent":
            for k, r in (("without", a), ("with", b)):
                lines.append(f"  {k} cache: per-step prefill {r['prefill_tokens_per_step'][0]} -> "
                             f"{r['prefill_tokens_per_step'][-1]} tokens, slope {r['per_step_slope_tokens']:.1f}/step: "
                             f"{r['total_growth']} total")
        lines.append(f"  identical outputs: {rep['identical_outputs']}")
    else:
        for p in ("static", "continuous"):
            r = rep[p]
            lines.append(f"  {p:10s}: {r['throughput_tok_s']:.1f} tok/s, latency p50/p90/p99 "
                         + "/".join(f"{r['latency_s'][q]:.1f}" for q in ("p50", "p90", "p99"))
                         + " s, TTFT p50/p90/p99 " + "/".join(f"{r['ttft_s'][q]:.1f}" for q in ("p50", "p90", "p99"))
                         + f" s, KV reserved/used {r['memory']['reserved_over_used']:.3f}")
        lines.append(f"  continuous / static throughput: {rep['throughput_ratio_continuous_over_static']:.2f}x, "
                     f"identical outputs: {rep['identical_outputs']}")
        for m in rep["block_sizes"]:
            lines.append(f"  block {m['block_size']:2d}: peak KV reserved {m['peak_reserved_bytes'] / 2**20:.1f} MiB "
                         f"vs used {m['used_bytes_at_peak'] / 2**20:.1f} MiB (x{m['reserved_over_used']:.3f} over "
                         f"the run), max waste {m['max_waste_tokens_per_sequence']} tokens/sequence, "
                         f"{m['block_table_entries']} table entries, wall {m['wall_s']:.1f} s")
    return "\n".join(lines)
