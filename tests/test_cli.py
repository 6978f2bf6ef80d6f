"""Bad input gets one clear line on stderr, a non-zero exit, and no traceback."""

import json
import shutil

import pytest

from conftest import SMOL, run_qbench


qbench = run_qbench


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("qbench: error: ")
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_missing_model_folder(tmp_path):
    assert_one_line_error(qbench("generate", str(tmp_path / "nope"), "hi"), "no such folder", "qbench pull")


def test_folder_without_config(tmp_path):
    assert_one_line_error(qbench("generate", str(tmp_path), "hi"), "no config.json")


def _model_with_weights(tiny_models, smollm2, dest, corrupt):
    """A tiny model folder (with SmolLM2's tokenizer) whose model.safetensors ``corrupt`` rewrites."""
    folder, _ = tiny_models["llama"]
    shutil.copytree(folder, dest)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / f, dest / f)
    (dest / "model.safetensors").write_bytes(corrupt((dest / "model.safetensors").read_bytes()))
    return str(dest)


def test_corrupt_weights(tiny_models, tmp_path, smollm2):
    bad = _model_with_weights(tiny_models, smollm2, tmp_path / "bad",
                              lambda _: b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert_one_line_error(qbench("generate", bad, "hi"), "model.safetensors", "not a safetensors file")


def test_truncated_weights(tiny_models, tmp_path, smollm2):
    bad = _model_with_weights(tiny_models, smollm2, tmp_path / "trunc", lambda data: data[: len(data) // 2])
    assert_one_line_error(qbench("generate", bad, "hi"), "corrupt entry")


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    assert_one_line_error(qbench("generate", str(tmp_path), "hi"), "model_type='bert'",
                          "supported: gpt2, llama, mistral, qwen2")


def test_prompt_longer_than_context(smollm2):
    assert_one_line_error(qbench("generate", SMOL, "word " * 9000), "context window is 8192")


@pytest.mark.parametrize("flag,value,field", [("--top-p", "1.5", "top_p"), ("--temperature", "-1", "temperature"),
                                              ("--top-k", "-3", "top_k"), ("--max-new-tokens", "0",
                                                                          "max_new_tokens")])
def test_invalid_sampling_parameters(flag, value, field):
    assert_one_line_error(qbench("generate", SMOL, "hi", flag, value), f"invalid sampling parameter {field}=")


def test_unreachable_hub_id_points_to_pull_and_local_folders():
    assert_one_line_error(qbench("generate", "someorg/some-model", "hi"), "someorg/some-model",
                          "qbench pull", "local model folder")


def test_malformed_prompts_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": \n')
    assert_one_line_error(qbench("generate", SMOL, "--prompts", str(f)), "p.jsonl:2")


def test_debug_shows_the_traceback(tmp_path):
    proc = qbench("--debug", "generate", str(tmp_path), "hi")
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def test_generate_with_a_quantized_kv_cache(smollm2):
    proc = qbench("generate", SMOL, "The capital of France is", "--kv", "kv8", "--max-new-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    fp = qbench("generate", SMOL, "The capital of France is", "--max-new-tokens", "6", "--json")
    assert json.loads(proc.stdout)["tokens"] == json.loads(fp.stdout)["tokens"]  # KV8 keeps greedy tokens here


def test_kv_flag_needs_a_recipe_with_a_kv_section(smollm2):
    assert_one_line_error(qbench("generate", SMOL, "hi", "--kv", "w8"), "w8: this recipe has no kv section")
    assert_one_line_error(qbench("generate", SMOL, "hi", "--kv", "kv8", "--backend", "hf"),
                          "quantized KV cache runs on qbench's engine only")
