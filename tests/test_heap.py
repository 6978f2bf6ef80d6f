"""heap.scratch: a pass's temporaries come from the heap and are reused from layer to layer, and the heap's
free memory is handed back when the outermost pass ends."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qbench import heap


def _record_calls(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(heap, "_mallopt", lambda p, v: calls.append(("mallopt", p, v)) or True)
    monkeypatch.setattr(heap, "release_free_memory", lambda: calls.append("release"))
    return calls


def test_only_the_outermost_scratch_sets_and_restores_the_thresholds(monkeypatch):
    calls = _record_calls(monkeypatch)
    with heap.scratch() as ok:
        assert ok
        entered = list(calls)
        with heap.scratch(), heap.calibration_heap():  # a forward inside a calibration, say
            pass
        assert calls == entered  # the inner exits neither restored the 1 MiB threshold nor trimmed
    assert entered == [("mallopt", heap.M_MMAP_THRESHOLD, heap.SCRATCH_MMAP_THRESHOLD),
                       ("mallopt", heap.M_TRIM_THRESHOLD, 1 << 30), ("mallopt", heap.M_MMAP_MAX, 0)]
    assert calls[len(entered):] == RESTORE
    assert heap._depth == 0


RESTORE = [("mallopt", heap.M_MMAP_MAX, heap.MMAP_MAX), ("mallopt", heap.M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD),
           ("mallopt", heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD), "release"]


def test_the_calibration_heap_keeps_mappings_for_its_largest_blocks(monkeypatch):
    # its float64 temporaries of a whole window can pass 32 MiB; as heap blocks they raised the peak RSS
    calls = _record_calls(monkeypatch)
    with heap.calibration_heap():
        assert ("mallopt", heap.M_MMAP_MAX, 0) not in calls
    assert calls[-len(RESTORE):] == RESTORE


def test_scratch_restores_after_an_error(monkeypatch):
    calls = _record_calls(monkeypatch)
    with pytest.raises(RuntimeError):
        with heap.scratch():
            raise RuntimeError("boom")
    assert heap._depth == 0 and calls[-len(RESTORE):] == RESTORE


def test_a_model_forward_runs_inside_scratch(tiny_models, monkeypatch):
    from qbench.engine.engine import Engine
    from qbench.engine.sampling import SamplingParams
    from qbench.models.registry import load_model

    model = load_model(tiny_models["llama"][0])
    depths = []
    model.blocks[0].register_forward_pre_hook(lambda mod, args: depths.append(heap._depth))
    calls = _record_calls(monkeypatch)
    Engine(model, max_batch=2).generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert depths and all(d == 1 for d in depths)  # every pass that runs the blocks one by one (the prefill here)
    assert calls.count("release") >= 1 and heap._depth == 0


# In a fresh process: what the heap holds depends on everything the process freed before (a test session's)
PREFILL_FAULTS = """
import contextlib, json, resource, sys, tempfile, torch
from transformers import LlamaConfig, LlamaForCausalLM
from qbench import heap
from qbench.engine.engine import Engine
from qbench.engine.sampling import SamplingParams
from qbench.models.registry import load_model

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
d = tempfile.mkdtemp()
LlamaForCausalLM(cfg).save_pretrained(d)
model = load_model(d)
if sys.argv[1] == "off":  # each temporary of 1 MiB or more its own mapping, as before scratch
    heap.scratch = contextlib.nullcontext
eng = Engine(model, max_batch=1)
prompt = torch.randint(0, 512, (1024,)).tolist()
sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
eng.generate([prompt], sp)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
eng.generate([list(reversed(prompt))], sp)  # another prompt: no prefix-cache hit
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "took": heap.fix_mmap_threshold()}))
"""


def _prefill_faults(mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PREFILL_FAULTS, mode], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_prefill_reuses_its_layers_temporaries():
    # 8 layers of a 1,024-token prefill, each with 1-8 MiB temporaries (gate_up's output is 8 MiB): as mappings
    # every layer faults its own in; from the heap the first layer's are reused by the other seven
    off = _prefill_faults("off")
    if not off["took"]:
        pytest.skip("this C library has no mallopt")
    on = min((_prefill_faults("on") for _ in range(2)), key=lambda r: r["faults"])
    assert on["faults"] < off["faults"] / 2, (on, off)
