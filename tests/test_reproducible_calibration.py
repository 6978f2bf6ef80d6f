"""Issue 21: a calibrated recipe gives the same artifact whichever code path computed its calibration.

Each case quantizes in a fresh process whose environment forces one path: qbench's kernels off (the torch
path), the kernels' AVX2 path on an AVX-512 CPU (QBENCH_ISA) with ATen, MKL and oneDNN held to AVX2 too,
no vector code anywhere (ATen's default capability, MKL's SSE4.2 path), and one thread instead of two (MKL
splits a long X^T X between threads). Every artifact's tensors must have the digest of the default path's.
The manifest's calibration_path shows that each environment took effect. SmolLM2's digests are also pinned to
another machine's (PINNED), so that a run here checks machine independence across machines too."""

import json
import os
import subprocess
import sys

import pytest
import torch

from qbench.kernels import build

AVX512 = "avx512f" in build.cpu_info()[1] and build.available() and build.load().qb_isa() == 512
# name -> (environment, what calibration_path must then say)
PATHS = {
    "torch": ({"QBENCH_NO_KERNELS": "1"}, {"qbench_kernels": "off"}),
    "scalar": ({"QBENCH_NO_KERNELS": "1", "ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "ONEDNN_MAX_CPU_ISA": "SSE41"}, {"qbench_kernels": "off", "aten_cpu_capability": "DEFAULT"}),
    "one-thread": ({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, {"threads": 1}),
}
if AVX512:
    PATHS["avx2"] = ({"QBENCH_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                      "ONEDNN_MAX_CPU_ISA": "AVX2"}, {"qbench_kernels": "avx2", "aten_cpu_capability": "AVX2"})

RECIPES = {
    "awq": "weights: {bits: 4, group_size: 128, symmetric: true, method: awq}\n",
    "awq-clip": "weights: {bits: 4, group_size: 64, symmetric: false, method: awq}\nawq: {clip: true}\n",
    "gptq": "weights: {bits: 4, group_size: 128, symmetric: true, method: gptq}\ngptq: {act_order: true}\n",
    "w8a8-sq": "weights: {bits: 8, group_size: null, method: rtn, activations: int8}\n"
               "smoothquant: {alpha: 0.5, search: true}\n",
}

# A tiny model has no tokenizer: random token windows, quantized in process; the digest of what calibration
# decides (codes, scales and zeros, and the norms and biases scales fold into), not of the modules' layouts,
# which differ with and without the kernels
TINY = """
import hashlib, json, pathlib, sys, torch
from qbench.models.registry import load_model
from qbench.quant.apply import quantize_model
from qbench.quant.quantize import calibration_path
from qbench.quant.recipe import load_recipe
model = load_model(pathlib.Path(sys.argv[1]))
calib = torch.randint(2, 128, (4, 48), generator=torch.Generator().manual_seed(1))
res = quantize_model(model, load_recipe(sys.argv[2]), calib, log=lambda *a: None)
h = hashlib.sha256()
for name, q in sorted(res.qtensors.items()):
    for t in (q.codes, q.scale, q.zero):
        h.update(name.encode() + (b"" if t is None else t.contiguous().view(torch.uint8).numpy().tobytes()))
for name, t in sorted(model.state_dict().items()):
    if name.endswith("bias") or "norm" in name or "ln_" in name:
        h.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
print(json.dumps({"digest": h.hexdigest(), "path": calibration_path()}))
"""


def _recipe(tmp_path, name: str, samples: int, seq_len: int, group: int | None = None):
    body = RECIPES[name] if group is None else RECIPES[name].replace("group_size: 128", f"group_size: {group}")
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\n{body}"
                    f"calibration: {{data: evals/data/wikitext-2-raw/wiki.valid.raw, samples: {samples}, "
                    f"seq_len: {seq_len}, seed: 0}}\n")
    return path


def _assert_one_digest(paths: list[str], run) -> str:
    """``run(name, env) -> (calibration_path record, digest)`` in a process with each path's environment, the
    default one first: each record shows that its environment took effect, and the digests are one (returned)."""
    got = {}
    for name in ["default", *paths]:
        env, expect = PATHS.get(name, ({}, {}))
        record, got[name] = run(name, dict(os.environ, HF_HUB_OFFLINE="1", **env))
        assert {k: record[k] for k in expect} == expect, (name, record)
    assert len(set(got.values())) == 1, got
    return got["default"]


@pytest.mark.parametrize("family, method", [("llama", "awq-clip"), ("qwen2", "w8a8-sq"), ("llama-tied-bias", "gptq"),
                                            ("gpt2", "gptq")])
def test_a_tiny_model_quantizes_to_one_digest_on_every_path(tiny_models, tmp_path, family, method):
    folder, _ = tiny_models[family]
    recipe = _recipe(tmp_path, method, 4, 48, group=32)

    def run(name, env):
        r = subprocess.run([sys.executable, "-c", TINY, str(folder), str(recipe)], capture_output=True, text=True,
                           env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        return out["path"], out["digest"]
    _assert_one_digest(list(PATHS), run)


# SmolLM2's runs take 25-70 s each: every method on the torch path and on another instruction set (AVX2 on an
# AVX-512 CPU, else no vector code), GPTQ also on one thread (its X^T X is the product MKL splits); the tiny
# models above take every path
OTHER_ISA = "avx2" if AVX512 else "scalar"


# weights_sha256 of each case below as a 2-core AMD EPYC with AVX2 only (no AVX-512) quantized it: a machine
# with another instruction set, CPU vendor or MKL code path must match it, or the calibration is not
# machine-independent (issue 21). Only torch 2.13.0 is pinned: another torch may round its float64 ops otherwise.
PINNED = {"awq": "b7e6cfd0cc3f5f616ce8c39267eb67c6415945d5b730cedc85fe7cd8ceba10b3",
          "gptq": "05d4bb6db7f384be16e715f81aa906b1c423956a5c17d148a46f53793fb4005b",
          "w8a8-sq": "f322a5e61da91796286b2a85f101fff7972f9465706be855d3573208d29b5e04"}


@pytest.mark.parametrize("method, paths", [("awq", ["torch", OTHER_ISA]),
                                           ("gptq", ["torch", OTHER_ISA, "one-thread"]),
                                           ("w8a8-sq", ["torch", OTHER_ISA])])
def test_smollm2_quantizes_to_one_digest_on_every_path(smollm2, tmp_path, method, paths):
    """SmolLM2 with a short calibration (2 windows of 128 tokens), through qbench quantize: the artifact's
    weights_sha256 on the default path and on forced ones."""
    recipe = _recipe(tmp_path, method, 2, 128)

    def run(name, env):
        art = tmp_path / f"{method}-{name}"
        r = subprocess.run([sys.executable, "-m", "qbench", "quantize", str(smollm2), "--recipe", str(recipe),
                            "--out", str(art)], capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        manifest = json.loads((art / "qbench.json").read_text())
        return manifest["calibration_path"], manifest["weights_sha256"]
    digest = _assert_one_digest(paths, run)
    if torch.__version__.split("+")[0] == "2.13.0":
        assert digest == PINNED[method], (f"{method} quantized SmolLM2 to {digest}, not to the digest another "
                                          f"machine pinned ({PINNED[method]})")
