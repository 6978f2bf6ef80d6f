"""``torchrun --nproc-per-node N -m qbench bench MODEL --tp ring|backend``: the tensor-parallel engine per rank,
and the ring all-reduce against the backend's, from decode-sized buffers up.

The smallest buffer holds one element per rank: its ring time is what the 2 (p - 1) dependent steps cost
with next to no bytes. At decode size (one hidden state per token) the report gives the share of the
ring's time that those steps account for; a line t = a + b * bytes_sent fitted over all sizes gives the
cost per byte.
"""

from __future__ import annotations

import statistics
import time

import torch

from qbench.bench.workload import bench_prompts
from qbench.dist.comm import Dist
from qbench.dist.ring import Collective, RingStats, expected_traffic, ring_all_reduce
from qbench.engine.sampling import SamplingParams


def _time(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, every rank starting each run together."""
    import torch.distributed as dist
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ring_sweep(hidden: int, sizes=None, reps: int = 100) -> dict:
    import torch.distributed as dist
    p = dist.get_world_size()
    sizes = sizes or [p, hidden, 4 * hidden, 16 * hidden, 2 ** 16, 2 ** 18, 2 ** 20]
    rows = []
    for n in sizes:
        x = torch.randn(n)
        ref = x.clone()
        dist.all_reduce(ref)
        st = RingStats()
        got = ring_all_reduce(x.clone(), st)
        ok = torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
        r = reps if n < 2 ** 16 else max(reps // 5, 5)  # medians of many short runs, fewer long ones
        ring_s = _time(lambda: ring_all_reduce(x.clone()), r)
        backend_s = _time(lambda: dist.all_reduce(x.clone()), r)
        rows.append({"numel": n, "buffer_bytes": x.nbytes, "steps": st.steps, "bytes_sent": st.bytes_sent,
                     **{k: v for k, v in expected_traffic(n, 4, p).items() if k != "bytes_sent_max"},
                     "equals_backend": ok, "ring_s": ring_s, "backend_s": backend_s})
    fit = statistics.linear_regression([r["bytes_sent"] for r in rows], [r["ring_s"] for r in rows])
    steps_only, decode = rows[0], rows[1]
    share = min(1.0, steps_only["ring_s"] / decode["ring_s"])
    return {"processes": p, "sizes": rows,
            "fit": {"per_step_s": steps_only["ring_s"] / (2 * (p - 1)), "per_byte_s": fit.slope},
            "decode": {"buffer_bytes": decode["buffer_bytes"], "ring_s": decode["ring_s"],
                       "steps_only_s": steps_only["ring_s"], "steps_share": share, "bytes_share": 1 - share}}


def run_tp_bench(model: str, allreduce: str, prompt_len: int = 64, gen_len: int = 32) -> dict | None:
    """Every rank runs this; rank 0 returns the report, the others None."""
    from qbench.engine.api import Generator

    d = Dist.from_env(required=True)
    gen = Generator(model, tp=allreduce, max_batch=1, prefix_cache=False)
    eng, m = gen.backend, gen.backend.model
    coll: Collective = m.tp.coll
    prompt = bench_prompts(gen.tokenizer, 1, prompt_len)
    eng.generate(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    eng.reset_stats()
    before = coll.all_reduces
    seq = eng.generate(prompt, SamplingParams(max_new_tokens=gen_len, ignore_eos=True))[0]
    st = eng.stats
    steps = len(st.decode_s) + len(st.prefill_s)
    mine = {"rank": d.rank, "weight_bytes": m.weight_bytes(), "kv_bytes_per_token": eng.pool.bytes_per_token,
            "kv_pool_bytes": eng.pool.nbytes, "heads": list(gen.shard.heads), "kv_heads": list(gen.shard.kv_heads),
            "intermediate": list(gen.shard.inter), "vocab": list(gen.shard.vocab),
            "decode_tok_s": sum(st.decode_batch) / sum(st.decode_s), "tokens": seq.output_ids,
            "all_reduces_per_forward": (coll.all_reduces - before) / steps}
    ranks = d.gather([(d.rank, mine)], d.world)
    sweep = ring_sweep(m.config.hidden_size)
    d.close()
    if not d.main:
        return None
    return {"model": model, "processes": d.world, "allreduce": allreduce, "prompt_len": prompt_len,
            "gen_len": gen_len, "ranks": ranks, "same_tokens_on_every_rank": all(r["tokens"] == ranks[0]["tokens"]
                                                                                 for r in ranks),
            "ring": sweep}


def render_tp(rep: dict) -> str:
    lines = [f"tensor parallel over {rep['processes']} processes, all-reduce: {rep['allreduce']}"]
    for r in rep["ranks"]:
        lines.append(f"  rank {r['rank']}: weights {r['weight_bytes'] / 2**20:.1f} MiB, KV {r['kv_bytes_per_token']} "
                     f"B/token, heads {r['heads']}, kv heads {r['kv_heads']}, MLP columns {r['intermediate']}, "
                     f"vocab {r['vocab']}; decode {r['decode_tok_s']:.1f} tok/s, "
                     f"{r['all_reduces_per_forward']:.0f} all-reduces per forward")
    ring = rep["ring"]
    lines.append(f"  ring all-reduce, p={ring['processes']}: {2 * (ring['processes'] - 1)} steps; "
                 f"{ring['fit']['per_step_s'] * 1e6:.0f} us per step (a {ring['sizes'][0]['buffer_bytes']}-byte buffer), "
                 f"{ring['fit']['per_byte_s'] * 1e9:.2f} ns per byte sent (fitted over all sizes)")
    for s in ring["sizes"]:
        lines.append(f"    {s['buffer_bytes']:>9d} B: sent {s['bytes_sent']:>9d} B (2(p-1)/p x buffer = "
                     f"{s['bytes_sent_ideal']:.0f}), ring {s['ring_s'] * 1e6:8.0f} us, backend "
                     f"{s['backend_s'] * 1e6:8.0f} us, equal: {s['equals_backend']}")
    dec = ring["decode"]
    lines.append(f"  at decode size ({dec['buffer_bytes']} B, one hidden state) the {2 * (ring['processes'] - 1)} steps "
                 f"take {dec['steps_share']:.0%} of the ring's time, the bytes {dec['bytes_share']:.0%}")
    return "\n".join(lines)
