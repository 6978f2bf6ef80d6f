"""The continuous-batching scheduler: exactly which requests run in each step, and preemption."""

import pytest

from qbench.engine.block_manager import BlockManager
from qbench.engine.engine import Engine
from qbench.engine.radix import RadixCache
from qbench.engine.sampling import SamplingParams
from qbench.engine.scheduler import Scheduler, SchedulerConfig
from qbench.engine.sequence import Sequence
from qbench.errors import QBenchError
from qbench.models.registry import load_model


def request(name, prompt_len, max_new=3, first=0):
    s = Sequence(list(range(first, first + prompt_len)), SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    s.seq_id = name
    return s


def simulate(sched: Scheduler, max_steps: int = 100) -> list[dict]:
    """Run the scheduler with a model that always emits token 1: what the engine does, minus the math."""
    log = []
    while not sched.done and len(log) < max_steps:
        step = sched.schedule()
        log.append(step.describe())
        for s in step.decodes:
            s.num_cached = len(s)
        for s, n in step.prefills:
            s.num_cached += n
        ready = step.decodes + [s for s, _ in step.prefills if sched.prefill_done(s)]
        for s in ready:
            s.output_ids.append(1)
            if len(s.output_ids) >= s.params.max_new_tokens:
                s.finish_reason = "length"
                sched.finish(s)
    return log


def test_each_step_runs_decodes_then_the_partial_prefill_then_new_requests_fcfs():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_seqs=4, token_budget=8), bm)
    for s in (request("A", 10), request("B", 3), request("C", 5), request("D", 2)):
        sched.add(s)
    log = simulate(sched)
    assert log == [
        # A's prompt is over the budget: its first 8 tokens
        {"decode": [], "prefill": [("A", 8)], "preempt": []},
        # the rest of A, then B whole, then as much of C as the budget leaves
        {"decode": [], "prefill": [("A", 2), ("B", 3), ("C", 3)], "preempt": []},
        # A and B decode first, then C's partial prefill ends, then D
        {"decode": ["A", "B"], "prefill": [("C", 2), ("D", 2)], "preempt": []},
        {"decode": ["A", "B", "C", "D"], "prefill": [], "preempt": []},
        # A and B ended with their third token
        {"decode": ["C", "D"], "prefill": [], "preempt": []},
    ]
    assert sched.done and bm.num_free == 64


def test_max_seqs_caps_the_running_set():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_seqs=2, token_budget=64), bm)
    for name in "ABC":
        sched.add(request(name, 3, max_new=2))
    log = simulate(sched)
    assert log[0]["prefill"] == [("A", 3), ("B", 3)]
    assert log[1] == {"decode": ["A", "B"], "prefill": [], "preempt": []}
    assert log[2]["prefill"] == [("C", 3)]  # a slot freed when A and B finished


def test_a_full_pool_preempts_the_newest_request_and_recomputes_it_first():
    bm = BlockManager(5, 4)  # 20 tokens
    sched = Scheduler(SchedulerConfig(max_seqs=4, token_budget=16), bm)
    a, b = request("A", 8, max_new=6), request("B", 8, max_new=6, first=50)
    sched.add(a)
    sched.add(b)
    log = simulate(sched)
    assert log[0] == {"decode": [], "prefill": [("A", 8), ("B", 8)], "preempt": []}
    # A's decode takes the last free block; B's then needs one: B, the newest, is preempted, and nothing
    # new is admitted in a step that preempts
    assert log[1] == {"decode": ["A"], "prefill": [], "preempt": ["B"]}
    # B comes back ahead of anything waiting, recomputing as much as the free blocks hold
    assert log[2] == {"decode": ["A"], "prefill": [("B", 8)], "preempt": []}
    # A needs a block again at token 12: B is preempted again; after A ends, B recomputes its 9 tokens
    assert log[5] == {"decode": ["A"], "prefill": [], "preempt": ["B"]}
    assert log[6] == {"decode": [], "prefill": [("B", 9)], "preempt": []}
    assert len(log) == 11
    assert sched.preemptions == 2 and sched.done
    assert a.output_ids == [1] * 6 and b.output_ids == [1] * 6
    assert bm.num_free == 5


def test_static_batching_admits_a_wave_only_when_nothing_runs():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_seqs=2, token_budget=64, policy="static"), bm,
                      budget_of=lambda s: len(s.prompt_ids) + s.params.max_new_tokens)
    sched.add(request("A", 3, max_new=2))
    sched.add(request("B", 3, max_new=4))
    sched.add(request("C", 3, max_new=2))
    log = simulate(sched)
    assert log[0]["prefill"] == [("A", 3), ("B", 3)]
    assert [x["decode"] for x in log[1:4]] == [["A", "B"], ["B"], ["B"]]  # C waits for the whole wave
    assert log[4]["prefill"] == [("C", 3)]


def test_a_request_sharing_a_prefix_in_flight_waits_for_it_and_then_hits_the_cache():
    bm = BlockManager(64, 4)
    cache = RadixCache(bm)
    sched = Scheduler(SchedulerConfig(max_seqs=4, token_budget=64), bm, cache)
    a, b = request("A", 12), request("B", 12)
    b.prompt_ids[-1] = 99  # shares 11 tokens: 2 whole blocks
    sched.add(a)
    sched.add(b)
    log = simulate(sched)
    assert log[0]["prefill"] == [("A", 12)]
    assert log[1]["prefill"] == [("B", 4)]  # the first 8 tokens came from the cache
    assert b.cached_tokens == 8 and sched.cached_tokens == 8


def test_bad_scheduler_settings_are_refused():
    with pytest.raises(QBenchError, match="token_budget"):
        SchedulerConfig(max_seqs=8, token_budget=4)
    with pytest.raises(QBenchError, match="policy"):
        SchedulerConfig(policy="fifo")


def test_preemption_in_the_engine_gives_the_same_tokens(tiny_models):
    folder, _ = tiny_models["llama"]
    model = load_model(folder)
    prompts = [list(range(2 + i, 14 + i)) for i in range(4)]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    roomy = Engine(model, block_size=4)
    tight = Engine(model, block_size=4, kv_capacity_tokens=48)  # 4 requests of 24 tokens in 48
    a = [s.output_ids for s in roomy.generate(prompts, sp)]
    b = [s.output_ids for s in tight.generate(prompts, sp)]
    assert tight.stats.preemptions > 0 and a == b
