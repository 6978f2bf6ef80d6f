"""Run each (backend, batch size) case in a fresh process and collect one report.

A fresh process per case makes peak RSS mean something: a long-lived process only
ever reports its all-time maximum, and its allocator keeps freed blocks (the seeds'
memory paradox). Weight and KV bytes are counted from the tensors themselves.
"""

from __future__ import annotations

import resource
import statistics
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from qbench.bench.isolate import CaseCrashed, run_isolated
from qbench.errors import QBenchError
from qbench.kernels.build import machine
from qbench.quant.qlinear import IMPLS

WARM_PROMPT = 512  # tokens of each prompt the untimed warm-up runs: an 8k-token prefill need not run twice
BACKENDS = ("qbench", "hf", "hf-generate", "llama.cpp", "nocache")


@dataclass(frozen=True)
class BenchConfig:
    model: str
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16)
    prompt_len: int = 64
    gen_len: int = 64
    backends: tuple[str, ...] = BACKENDS
    nocache_batch_sizes: tuple[int, ...] = (1, 4)
    dtype: str = "fp32"
    variants: tuple[str, ...] = ()  # quantized artifacts run on qbench's engine beside the fp model
    qlinear: tuple[str, ...] = ("native",)  # which low-bit kernels run the variants (see quant/qlinear.py)
    kv: tuple[str, ...] = ()  # recipes whose kv section runs the fp model with a quantized KV cache
    rounds: int = 1  # every case this many times, round-robin; figures are medians, ratios paired per round

    def __post_init__(self):
        for b in self.backends:
            if b not in BACKENDS:
                raise QBenchError(f"bench: unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise QBenchError("bench: --batch-sizes must be positive integers, e.g. 1,4,8,16")
        for q in self.qlinear:
            if q not in IMPLS:
                raise QBenchError(f"bench: --qlinear {q!r}; choose from {', '.join(IMPLS)}")
        if self.rounds < 1:
            raise QBenchError(f"bench: --rounds must be at least 1, got {self.rounds}")
        if self.prompt_len < 1 or self.gen_len < 2:
            raise QBenchError("bench: --prompt-len must be >= 1 and --gen-len >= 2")
        if self.kv and "qbench" not in self.backends:
            raise QBenchError("bench: --kv compares against qbench's fp cache; keep qbench in --backends")
        from qbench.quant.recipe import load_kv_scheme
        for spec in self.kv:
            load_kv_scheme(spec)  # a bad recipe fails here, before any case runs

    @classmethod
    def parse(cls, model, batch_sizes, prompt_len, gen_len, backends, nocache_batch_sizes, dtype, variants=(),
              qlinear="native", kv=(), rounds=1):
        def ints(s, name):
            try:
                return tuple(int(x) for x in s.split(",") if x.strip())
            except ValueError:
                raise QBenchError(f"bench: {name} must be a comma list of integers, got {s!r}") from None
        return cls(model=model, batch_sizes=ints(batch_sizes, "--batch-sizes"), prompt_len=prompt_len,
                   gen_len=gen_len, backends=tuple(b.strip() for b in backends.split(",") if b.strip()),
                   nocache_batch_sizes=ints(nocache_batch_sizes, "--nocache-batch-sizes"), dtype=dtype,
                   variants=tuple(variants), qlinear=tuple(x.strip() for x in qlinear.split(",") if x.strip()),
                   kv=tuple(kv), rounds=rounds)


def summarize(raw: dict, prompt_tokens: int) -> dict:
    steps = raw["decode_s"]
    n = len(steps)
    q = max(n // 4, 1)
    ms = sorted(1000 * s for s in steps)
    out = {
        "prefill_tok_s": prompt_tokens / raw["prefill_s"],
        "decode_tok_s": raw["batch"] * n / sum(steps),
        "decode_steps": n,
        "step_ms": {"mean": statistics.fmean(ms), "p50": ms[n // 2], "p90": ms[min(n - 1, int(0.9 * n))],
                    "max": ms[-1]},
        # mean step time per quarter of the run: flat when the cache works, rising without it
        # (fewer than four steps, as at --gen-len 4: one entry per step)
        "step_ms_by_quarter": [1000 * statistics.fmean(steps[i: i + q]) for i in range(0, min(q * 4, n), q)],
    }
    return out


def run_case(case: dict) -> dict:
    """Runs in a fresh process. Returns the raw measurements of one backend at one batch size."""
    import torch

    from qbench.bench.peers import hf_cache_bytes, llama_cpp_build, run_hf_generate, run_llama_cpp
    from qbench.bench.workload import bench_prompts
    from qbench.engine.api import load_tokenizer
    from qbench.models.registry import DTYPES, load_model
    from qbench.models.zoo import gguf_path, resolve_model

    if "qlinear" in case:
        import os
        os.environ["QBENCH_QLINEAR"] = case["qlinear"]
    folder = resolve_model(case["model"])
    tok = load_tokenizer(folder)
    B, P, G, backend = case["batch"], case["prompt_len"], case["gen_len"], case["backend"]
    prompts = bench_prompts(tok, B, P)
    dtype = DTYPES[case["dtype"]]
    esize = dtype.itemsize
    res: dict = {"backend": backend, "label": case["label"], "batch": B}
    if backend in ("qbench", "nocache", "hf"):
        from qbench.engine.engine import Engine
        from qbench.engine.hf_backend import HFBackend, load_hf_model
        from qbench.engine.nocache import NoCacheEngine
        from qbench.engine.sampling import SamplingParams

        if backend == "hf":
            hf = load_hf_model(folder, dtype)
            runner = HFBackend(hf, 10 ** 9, set(), pad_id=tok.pad_token_id or 0)
            res.update(_hf_sizes(hf, folder, esize))
        else:
            from qbench.layers.kvscheme import kv_memory
            from qbench.quant.artifact import artifact_kv_scheme, is_artifact, load_artifact
            from qbench.quant.recipe import load_kv_scheme
            scheme = None
            params = None
            if is_artifact(folder):
                model, manifest = load_artifact(folder, dtype)
                scheme = artifact_kv_scheme(manifest, str(folder))
                params = manifest.get("size", {}).get("parameters")
            else:
                model = load_model(folder, dtype)
            if case.get("kv"):
                scheme = load_kv_scheme(case["kv"])
            if backend == "qbench":
                bs = 16 if scheme is None else scheme.group
                # the pool the timed call needs, made now, so that a short warm-up runs on it (an evicting cache's
                # pool holds each sequence's budget plus one block, and one whole prompt at a time: engine/footprint.py)
                runner = Engine(model, max_batch=B, kv_scheme=scheme, block_size=bs)
                runner.size_pool_for(prompts, SamplingParams(max_new_tokens=G, ignore_eos=True))
            else:
                runner = NoCacheEngine(model)
            res["weight_bytes"] = model.weight_bytes()
            if backend == "qbench":  # the no-cache engine recomputes the prompt every step: no such ceiling
                res["decode_weight_bytes"] = model.decode_weight_bytes()
            # bits per weight over every tensor held, per source parameter (the headline size)
            params = params or res["weight_bytes"] // esize
            res["bits_per_weight"] = 8 * res["weight_bytes"] / params
            cfg = model.config
            res["kv"] = kv_memory(scheme, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, esize)
        warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
        runner.generate([p[:WARM_PROMPT] for p in prompts], warm)  # kernels and pool touched; long prefills once
        runner.stats.__init__()
        seqs = runner.generate(prompts, SamplingParams(max_new_tokens=G, ignore_eos=True))
        st = runner.stats
        raw = {"prefill_s": sum(st.prefill_s), "decode_s": st.decode_s, "batch": B}
        res["tokens"] = [s.output_ids for s in seqs]
        if backend == "qbench":
            res["decode_path"] = "one call per step" if runner.runner.fused else "layer by layer"
            res["kv_bytes_reserved"] = runner.pool.nbytes
            res["kv_bytes_used"] = sum(len(s) - 1 for s in seqs) * runner.pool.bytes_per_token
            if runner.eviction is not None:  # what the sequences held at most while decoding, and read per step
                res["kv_bytes_used"] = st.decode_blocks * runner.pool.block_nbytes
                res["decode_context"] = sum(st.decode_context) / max(sum(st.decode_batch), 1)
                res["kv_eviction"] = runner.eviction.describe()
            res["kv_bytes_per_token"] = runner.pool.bytes_per_token
            # a quantized cache also reads its full-precision residual window, a fixed size per sequence
            res["decode_kv_bytes_per_token"] = res["kv"]["bytes_per_token"]
            res["decode_kv_bytes_per_sequence"] = res["kv"]["residual_bytes_per_sequence"]
        elif backend == "hf":
            res["kv_bytes_reserved"] = res["kv_bytes_used"] = hf_cache_bytes(runner.last_cache)
        else:
            res["kv_bytes_reserved"] = res["kv_bytes_used"] = 0
    elif backend == "hf-generate":
        from qbench.engine.hf_backend import load_hf_model

        hf = load_hf_model(folder, dtype)
        res.update(_hf_sizes(hf, folder, esize))
        pad = tok.pad_token_id or 0
        run_hf_generate(hf, prompts, 4, pad)
        raw = run_hf_generate(hf, prompts, G, pad)
        res["kv_bytes_reserved"] = res["kv_bytes_used"] = raw.pop("kv_bytes")
        res["tokens"] = raw.pop("tokens")
    elif backend == "llama.cpp":
        gguf = gguf_path(folder)
        run_llama_cpp(gguf, prompts, 4, torch.get_num_threads())
        raw = run_llama_cpp(gguf, prompts, G, torch.get_num_threads())
        res["weight_bytes"] = raw.pop("weight_bytes")
        res["decode_weight_bytes"] = raw.pop("decode_weight_bytes")
        res["decode_kv_bytes_per_token"] = _fp_kv_bytes(folder, 2)  # llama.cpp's default cache is f16
        res["tokens"] = raw.pop("tokens")
        res["llama_cpp_build"] = llama_cpp_build()
    else:
        raise ValueError(backend)
    res.update(summarize(raw, B * P))
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def _hf_sizes(hf, folder, element_size: int) -> dict:
    """A transformers model's held weight bytes, and what one decode step reads of weights and fp KV."""
    from qbench.bench.peers import hf_decode_bytes
    from qbench.models.base import unique_storage_bytes
    return {"weight_bytes": unique_storage_bytes(hf.state_dict().values()), "decode_weight_bytes": hf_decode_bytes(hf),
            "decode_kv_bytes_per_token": _fp_kv_bytes(folder, element_size)}


def _fp_kv_bytes(folder, element_size: int) -> int:
    from qbench.models.config import ModelConfig
    return ModelConfig.from_folder(folder).kv_bytes_per_token * element_size


def plan(cfg: BenchConfig) -> tuple[list[dict], list[str]]:
    from qbench.bench.peers import llama_cpp_available
    from qbench.models.zoo import gguf_path, resolve_model

    folder = resolve_model(cfg.model)
    cases, skipped = [], []
    for backend in cfg.backends:
        if backend == "llama.cpp":
            if not llama_cpp_available():
                skipped.append("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python)")
                continue
            if gguf_path(folder) is None:
                skipped.append("llama.cpp: this model has no source GGUF (only zoo models do)")
                continue
        for b in cfg.batch_sizes:
            if backend == "nocache" and b not in cfg.nocache_batch_sizes:
                continue
            cases.append({"backend": backend, "label": backend, "batch": b, "model": cfg.model,
                          "prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len, "dtype": cfg.dtype})
    for v in cfg.variants:
        resolve_model(v)
        for impl in cfg.qlinear:
            suffix = "" if impl == "native" else f"/{impl}"
            for b in cfg.batch_sizes:
                cases.append({"backend": "qbench", "label": f"qbench[{_variant_name(v)}{suffix}]", "batch": b,
                              "model": v, "prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len,
                              "dtype": cfg.dtype, "qlinear": impl})
    for spec in cfg.kv:
        from qbench.quant.recipe import load_recipe
        name = load_recipe(spec).name
        for b in cfg.batch_sizes:
            cases.append({"backend": "qbench", "label": f"qbench[{name}]", "batch": b, "model": cfg.model,
                          "prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len, "dtype": cfg.dtype, "kv": spec})
    return cases, skipped


def _variant_name(spec: str) -> str:
    from pathlib import Path

    from qbench.quant.artifact import is_artifact, read_manifest
    from qbench.models.zoo import resolve_model
    folder = resolve_model(spec)
    return read_manifest(folder)["recipe"]["name"] if is_artifact(folder) else Path(spec).name


def run_bench(cfg: BenchConfig, log=print) -> dict:
    from qbench.bench.roofline import attach, describe_bandwidth, read_bandwidth
    from qbench.bench.figures import agreement, combine_case, combine_ratios, ratios

    cases, skipped = plan(cfg)
    for s in skipped:
        log(f"skipping {s}")
    rows: list[list[dict]] = [[] for _ in cases]  # per case, one row per round
    round_ratios, round_prefill, probes, dead = [], [], [], set()
    for rnd in range(1, cfg.rounds + 1):
        tag = f" (round {rnd}/{cfg.rounds})" if cfg.rounds > 1 else ""
        # in a process of its own, before the cases: its multi-GiB buffer here would be inherited by every
        # case's peak RSS (Linux keeps the high-water mark across fork and exec)
        probes.append(run_isolated(read_bandwidth, {}))
        log(f"read bandwidth{tag}: {describe_bandwidth(probes[-1])}")
        this_round = []
        for i, case in enumerate(cases):
            if i in dead:
                continue
            log(f"[{i + 1}/{len(cases)}]{tag} {case['label']} batch {case['batch']} ...")
            try:
                rows[i].append(run_isolated(run_case, case))
            except CaseCrashed as e:
                if case["backend"] != "llama.cpp":
                    raise QBenchError(f"bench: {case['label']} batch {case['batch']}: {e}") from None
                # a peer that cannot run here is reported, not fatal: qbench's own rows still stand
                skipped.append(f"{case['label']} batch {case['batch']}: {e}")
                log(f"skipping {skipped[-1]}")
                dead.add(i)
                continue
            this_round.append(rows[i][-1])
        round_ratios.append(ratios(this_round))  # paired: both sides of a ratio ran in this round
        round_prefill.append(ratios(this_round, "prefill_tok_s"))
    bandwidth = max(probes, key=lambda p: p["bytes_per_s"])  # the machine's ability; a slower probe met a busy host
    if cfg.rounds > 1:
        bandwidth = dict(bandwidth, method=f"the highest of {cfg.rounds} rounds' {bandwidth['method']}",
                         rounds_bytes_per_s=[p["bytes_per_s"] for p in probes])
    results = [combine_case(r) for r in rows if r]
    agreement(results)
    for r in results:
        attach(r, bandwidth["bytes_per_s"], cfg.prompt_len, cfg.gen_len)
    median_ratios, every_round = combine_ratios(round_ratios)
    prefill_ratios, every_prefill = combine_ratios(round_prefill)
    report = {
        "config": asdict(cfg),
        "machine": dict(machine(), read_bandwidth=bandwidth),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "skipped": skipped,
        "results": results,
        "ratios": median_ratios,
        "prefill_ratios": prefill_ratios,
    }
    if cfg.rounds > 1:
        report["ratio_rounds"] = every_round
        report["prefill_ratio_rounds"] = every_prefill
    return report
