"""Every user mistake: exit 2, one `qbench: error:` line that names what went wrong, and no file outside
qbench's own outputs changed (a snapshot of the whole working tree before and after each case).

The commands run in-process (``qbench.cli.main``) against a small world built once: a tiny Llama with
SmolLM2's tokenizer, an INT4 artifact of it, a baseline eval run and a candidate run, and a folder of the
user's own files. Each case works on a fresh copy of that world.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from qbench.cli import main

SUITE = """name: mini
seed: 3
batch_size: 2
tasks:
  kld: {data: evals/data/wikitext-2-raw/wiki.test.raw, ctx: 32, chunks: 2, top_k: 8}
"""
LATIN1 = "name: caf\xe9\n".encode("latin-1")  # not UTF-8


@pytest.fixture(scope="module")
def world(tmp_path_factory, smollm2):
    from transformers import LlamaConfig, LlamaForCausalLM
    w = tmp_path_factory.mktemp("world")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(str(w / "model"))
    for f in smollm2.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, w / "model" / f.name)
    (w / "suite.yaml").write_text(SUITE)
    old = os.getcwd()
    os.chdir(w)
    try:
        for argv in (["quantize", "model", "--recipe", "w4g64", "--out", "art"],
                     ["eval", "model", "--suite", "suite.yaml", "--out", "runs/fp"],
                     ["eval", "art", "--suite", "suite.yaml", "--out", "runs/q", "--baseline", "runs/fp"],
                     ["compare", "runs/fp", "runs/q", "--out", "report"]):
            assert call(argv)[0] == 0, argv
    finally:
        os.chdir(old)
    (w / "mine").mkdir()
    (w / "mine" / "notes.txt").write_text("the user's own notes")
    (w / "mine" / ".env").write_text("TOKEN=secret")
    (w / "repo" / ".git").mkdir(parents=True)
    (w / "repo" / "code.py").write_text("print('mine')")
    (w / "a-file").write_text("a file, not a folder")
    return w


def call(argv):
    """(exit code, stderr) of ``qbench ARGV`` run in this process."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main([str(a) for a in argv])
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def snapshot(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        data = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
        out[str(p.relative_to(root))] = (st.st_mode, data)
    return out


def write(path, data):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def recipe(text):
    return lambda w: write(w / "r.yaml", text)


def suite(text):
    return lambda w: write(w / "s.yaml", text)


def edit_json(rel, fn):
    def setup(w):
        p = w / rel
        p.write_text(json.dumps(fn(json.loads(p.read_text()))))
    return setup


def truncate(rel_glob):
    def setup(w):
        p = next(w.glob(rel_glob))
        p.write_bytes(p.read_bytes()[:40])
    return setup


def flip_byte(w):
    p = w / "art" / "model.safetensors"
    b = bytearray(p.read_bytes())
    b[-10] ^= 1
    p.write_bytes(bytes(b))


def change_data(w):
    write(w / "wiki.raw", (Path(__file__).parents[1] / "evals/data/wikitext-2-raw/wiki.test.raw").read_bytes()[:200_000])
    write(w / "s1.yaml", SUITE.replace("evals/data/wikitext-2-raw/wiki.test.raw", "wiki.raw"))
    assert call(["eval", "model", "--suite", "s1.yaml", "--out", "base1"])[0] == 0
    write(w / "wiki.raw", (w / "wiki.raw").read_bytes().replace(b" the ", b" THE ", 1))


Q = ["quantize", "model", "--recipe"]
GOOD = "name: r\nweights: {bits: 4, group_size: 64}\n"
CASES = {
    # quantize: the model, the recipe (every field's type checked in one place), --out
    "quantize-unknown-model": (None, ["quantize", "nosuch-model", "--recipe", "w8", "--out", "o"], "nosuch-model"),
    "quantize-folder-without-config": (lambda w: (w / "empty").mkdir(), ["quantize", "empty", "--recipe", "w8",
                                                                          "--out", "o"], "empty"),
    "quantize-unknown-recipe": (None, Q + ["w5", "--out", "o"], "no such recipe"),
    "quantize-recipe-not-utf8": (lambda w: write(w / "r.yaml", LATIN1), Q + ["r.yaml", "--out", "o"], "not UTF-8"),
    "quantize-recipe-a-list": (recipe("- 1\n- 2\n"), Q + ["r.yaml", "--out", "o"], "a recipe is a YAML mapping"),
    "quantize-recipe-bad-yaml": (recipe("name: [\n"), Q + ["r.yaml", "--out", "o"], "not valid YAML"),
    "quantize-recipe-empty": (recipe(""), Q + ["r.yaml", "--out", "o"], "a recipe is a YAML mapping"),
    "quantize-weights-a-list": (recipe("name: r\nweights: [4, 128]\n"), Q + ["r.yaml", "--out", "o"], "weights"),
    "quantize-group-size-float": (recipe("name: r\nweights: {bits: 4, group_size: 128.0}\n"),
                                  Q + ["r.yaml", "--out", "o"], "group_size"),
    "quantize-skip-an-int": (recipe("name: r\nweights: {bits: 4, group_size: 64, skip: 5}\n"),
                             Q + ["r.yaml", "--out", "o"], "skip"),
    "quantize-gptq-damp-text": (recipe("name: r\nweights: {bits: 4, group_size: 64, method: gptq}\n"
                                       "gptq: {damp: lots}\n"), Q + ["r.yaml", "--out", "o"], "damp"),
    "quantize-bits-3": (recipe("name: r\nweights: {bits: 3, group_size: 64}\n"), Q + ["r.yaml", "--out", "o"],
                        "bits"),
    "quantize-unknown-field": (recipe("name: r\nweights: {bits: 4, group_size: 64, colour: red}\n"),
                               Q + ["r.yaml", "--out", "o"], "colour"),
    "quantize-embedding-int4": (recipe("name: r\nweights: {bits: 4, group_size: 64, embedding: int4}\n"),
                                Q + ["r.yaml", "--out", "o"], "embedding"),
    "quantize-head-2-bit": (recipe("name: r\nweights: {bits: 4, group_size: 64, lm_head: {bits: 2}}\n"),
                            Q + ["r.yaml", "--out", "o"], "lm_head"),
    "quantize-name-a-number": (recipe("name: 5\nweights: {bits: 8}\n"), Q + ["r.yaml", "--out", "o"], "name"),
    "quantize-kv-bits-text": (recipe("name: r\nkv: {k_bits: four, v_bits: 4}\n"), Q + ["r.yaml", "--out", "o"],
                              "k_bits"),
    "quantize-calibration-zero": (None, Q + ["w4g128-awq", "--out", "o", "--calibration-samples", "0"],
                                  "--calibration-samples 0"),
    "quantize-calibration-on-rtn": (None, Q + ["w8", "--out", "o", "--calibration-samples", "2"],
                                    "uses no calibration data"),
    "quantize-an-artifact": (None, ["quantize", "art", "--recipe", "w8", "--out", "o"], "already a quantized"),
    "quantize-out-a-file": (None, Q + ["w8", "--out", "a-file"], "is a file, not a folder"),
    "quantize-out-under-a-file": (None, Q + ["w8", "--out", "a-file/x"], "is a file, so no folder"),
    "quantize-out-dot": (None, Q + ["w8", "--out", "."], "current folder"),
    "quantize-out-users-folder": (None, Q + ["w8", "--out", "mine"], "not an output qbench wrote"),
    "quantize-out-users-folder-force": (None, Q + ["w8", "--out", "mine", "--force"], "not an output qbench wrote"),
    "quantize-out-git-force": (None, Q + ["w8", "--out", "repo", "--force"], "holds a .git folder"),
    "quantize-out-qbench-json-and-more": (lambda w: (write(w / "d" / "qbench.json", "{}"), write(w / "d" / "x", "mine")),
                                          Q + ["w8", "--out", "d"], "not an output qbench wrote"),
    "quantize-out-a-report": (None, Q + ["w8", "--out", "report"], "holds a qbench report, not an artifact"),
    "quantize-out-artifact-with-user-file": (lambda w: write(w / "art" / "mine.txt", "x"),
                                             Q + ["w8", "--out", "art", "--force"], "holds mine.txt"),
    # export
    "export-not-an-artifact": (None, ["export", "model", "--out", "e"], "not a qbench artifact"),
    "export-missing-artifact": (None, ["export", "nope", "--out", "e"], "not a qbench artifact"),
    "export-out-users-folder": (None, ["export", "art", "--out", "mine"], "not an output qbench wrote"),
    "export-out-dot": (None, ["export", "art", "--out", "."], "current folder"),
    "export-out-a-file": (None, ["export", "art", "--out", "a-file"], "is a file, not a folder"),
    "export-out-the-artifact": (None, ["export", "art", "--out", "art", "--force"], "not an export"),
    "export-bad-format": (None, ["export", "art", "--format", "gguf", "--out", "e"], "gguf"),
    "export-manifest-a-list": (lambda w: write(w / "art" / "qbench.json", "[1, 2]"), ["export", "art", "--out", "e"],
                               "qbench.json"),
    "export-flipped-byte": (flip_byte, ["export", "art", "--out", "e"], "sha256 is not the one"),
    # generate
    "generate-prompts-not-utf8": (lambda w: write(w / "p.jsonl", b'{"prompt": "caf\xe9"}\n'),
                                  ["generate", "model", "--prompts", "p.jsonl"], "not UTF-8"),
    "generate-prompts-bad-json": (lambda w: write(w / "p.jsonl", '{"prompt": }\n'),
                                  ["generate", "model", "--prompts", "p.jsonl"], "p.jsonl:1"),
    "generate-prompts-no-prompt": (lambda w: write(w / "p.jsonl", '{"text": "hi"}\n'),
                                   ["generate", "model", "--prompts", "p.jsonl"], "prompt"),
    "generate-prompts-missing": (None, ["generate", "model", "--prompts", "nope.jsonl"], "no such prompts file"),
    "generate-two-prompt-sources": (lambda w: write(w / "p.jsonl", '{"prompt": "hi"}\n'),
                                    ["generate", "model", "hi", "--prompts", "p.jsonl"], "exactly one"),
    "generate-negative-tokens": (None, ["generate", "model", "hi", "--max-new-tokens", "-1"], "max_new_tokens"),
    "generate-negative-temperature": (None, ["generate", "model", "hi", "--temperature", "-1"], "temperature"),
    "generate-top-p-above-one": (None, ["generate", "model", "hi", "--top-p", "1.5"], "top_p"),
    "generate-missing-model": (None, ["generate", "nope-folder", "hi"], "nope-folder"),
    "generate-flipped-byte": (flip_byte, ["generate", "art", "hi"], "sha256 is not the one"),
    "generate-batch-size-zero": (None, ["generate", "model", "hi", "--batch-size", "0"], "--batch-size"),
    # eval: the suite (and its data) is checked before the run folder is made
    "eval-missing-suite": (None, ["eval", "model", "--suite", "nope.yaml", "--out", "r"], "no such suite"),
    "eval-suite-not-utf8": (lambda w: write(w / "s.yaml", LATIN1), ["eval", "model", "--suite", "s.yaml", "--out", "r"],
                            "not UTF-8"),
    "eval-suite-a-list": (suite("- kld\n"), ["eval", "model", "--suite", "s.yaml", "--out", "r"], "mapping"),
    "eval-suite-unknown-task": (suite("name: s\ntasks: {mmlu: {}}\n"), ["eval", "model", "--suite", "s.yaml",
                                                                       "--out", "r"], "unknown task"),
    "eval-suite-ctx-text": (suite(SUITE.replace("ctx: 32", "ctx: big")), ["eval", "model", "--suite", "s.yaml",
                                                                         "--out", "r"], "ctx"),
    "eval-suite-tasks-a-list": (suite("name: s\ntasks: [kld]\n"), ["eval", "model", "--suite", "s.yaml", "--out", "r"],
                                "tasks"),
    "eval-data-missing": (suite(SUITE.replace("evals/data/wikitext-2-raw/wiki.test.raw", "nope.raw")),
                          ["eval", "model", "--suite", "s.yaml", "--out", "r"], "nope.raw"),
    "eval-data-not-utf8": (lambda w: (write(w / "bad.raw", b"caf\xe9 " * 100), suite(SUITE.replace(
        "evals/data/wikitext-2-raw/wiki.test.raw", "bad.raw"))(w)), ["eval", "model", "--suite", "s.yaml", "--out",
                                                                      "r"], "not UTF-8"),
    "eval-batch-size-zero": (None, ["eval", "model", "--suite", "suite.yaml", "--out", "r", "--batch-size", "0"],
                             "--batch-size"),
    "eval-batch-size-negative": (None, ["eval", "model", "--suite", "suite.yaml", "--out", "r", "--batch-size", "-3"],
                                 "--batch-size"),
    "eval-out-a-file": (None, ["eval", "model", "--suite", "suite.yaml", "--out", "a-file"], "a-file"),
    "eval-out-under-a-file": (None, ["eval", "model", "--suite", "suite.yaml", "--out", "a-file/r"], "a-file"),
    "eval-out-users-folder": (None, ["eval", "model", "--suite", "suite.yaml", "--out", "mine"], "not a qbench eval run"),
    "eval-out-dot": (None, ["eval", "model", "--suite", "suite.yaml", "--out", "."], "not a qbench eval run"),
    "eval-missing-baseline": (None, ["eval", "art", "--suite", "suite.yaml", "--out", "r", "--baseline", "nope"],
                              "nope"),
    "eval-baseline-results-a-list": (lambda w: write(w / "runs/fp/results.json", "[]"),
                                     ["eval", "art", "--suite", "suite.yaml", "--out", "r", "--baseline", "runs/fp"],
                                     "results.json"),
    "eval-baseline-other-data": (change_data, ["eval", "art", "--suite", "s1.yaml", "--out", "r", "--baseline",
                                               "base1"], "re-run the baseline"),
    "eval-unknown-kv": (None, ["eval", "model", "--suite", "suite.yaml", "--out", "r", "--kv", "kv3"], "kv3"),
    "eval-run-json-a-list": (lambda w: write(w / "r" / "run.json", "[]"), ["eval", "model", "--suite", "suite.yaml",
                                                                         "--out", "r"], "run.json"),
    # compare
    "compare-missing-run": (None, ["compare", "runs/fp", "nope", "--out", "c"], "not a finished qbench eval run"),
    "compare-out-users-folder": (None, ["compare", "runs/fp", "runs/q", "--out", "mine"], "not an output qbench wrote"),
    "compare-out-dot": (None, ["compare", "runs/fp", "runs/q", "--out", "."], "current folder"),
    "compare-out-a-file": (None, ["compare", "runs/fp", "runs/q", "--out", "a-file"], "is a file, not a folder"),
    "compare-out-dotfiles-only": (lambda w: (write(w / "dots" / ".git" / "HEAD", "x"), write(w / "dots" / ".env", "x")),
                                  ["compare", "runs/fp", "runs/q", "--out", "dots", "--force"], "holds a .git"),
    "compare-out-summary-json": (lambda w: write(w / "s" / "summary.json", "{}"),
                                 ["compare", "runs/fp", "runs/q", "--out", "s"], "not an output qbench wrote"),
    "compare-out-an-artifact": (None, ["compare", "runs/fp", "runs/q", "--out", "art"], "holds a qbench artifact"),
    "compare-truncated-part": (truncate("runs/q/parts/*/*.safetensors"), ["compare", "runs/fp", "runs/q", "--out",
                                                                          "c"], "runs/q"),
    "compare-results-a-list": (lambda w: write(w / "runs/q/results.json", "[1]"),
                               ["compare", "runs/fp", "runs/q", "--out", "c"], "results.json"),
    "compare-results-not-utf8": (lambda w: write(w / "runs/q/results.json", b"\xff\xfe{"),
                                 ["compare", "runs/fp", "runs/q", "--out", "c"], "results.json"),
    # bench: its JSON report never overwrites a file it did not write
    "bench-out-users-file": (lambda w: write(w / "data.json", '{"mine": 1}'),
                             ["bench", "model", "--out", "data.json"], "not a report qbench bench wrote"),
    "bench-out-a-folder": (None, ["bench", "model", "--out", "mine"], "is a folder"),
    # pull
    "pull-unknown-model": (None, ["pull", "gpt-5"], "unknown zoo model"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_user_mistake_is_one_line_exit_2_and_changes_nothing(case, world, tmp_path, monkeypatch):
    setup, argv, fragment = CASES[case]
    w = tmp_path / "w"
    shutil.copytree(world, w, symlinks=True)
    monkeypatch.chdir(w)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("QBENCH_HOME", str(w / ".home"))  # a pull writes nowhere else
    if setup is not None:
        setup(w)
    before = snapshot(w)
    code, err = call(argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("qbench: error:") and fragment in lines[0], err
    assert "Traceback" not in err and "internal error" not in err, err
    assert snapshot(w) == before, "the failed command changed files"


def test_there_are_at_least_60_cases():
    assert len(CASES) >= 60


LONG_SUITE = """name: long
seed: 3
batch_size: 2
tasks:
  kld: {data: evals/data/wikitext-2-raw/wiki.test.raw, ctx: 64, chunks: 24, top_k: 8}
  perplexity: {data: evals/data/wikitext-2-raw/wiki.test.raw, ctx: 64, chunks: 24, rolling_docs: 3, rolling_len: 256}
"""


def _popen(argv, cwd):
    import subprocess
    import sys
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "qbench", *map(str, argv)], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _strip(rec):
    drop = {"seconds", "task_seconds", "finished", "throughput", "versions", "machine", "decode_s", "prefill_s", "items_per_s"}
    if isinstance(rec, dict):
        return {k: _strip(v) for k, v in rec.items() if k not in drop}
    if isinstance(rec, list):
        return [_strip(v) for v in rec]
    return rec


def _outcome(kind, w, out):
    """What a finished command left: the content digest of an artifact or export, or a run's numbers."""
    from qbench.quant.quantize import tensors_sha256
    if kind == "eval":
        return _strip(json.loads((w / out / "results.json").read_text()))
    return tensors_sha256(w / out / "model.safetensors")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
@pytest.mark.parametrize("kind", ["quantize", "export", "eval"])
def test_an_interrupted_command_leaves_nothing_half_written_and_a_rerun_gives_identical_results(
        kind, sig, world, tmp_path):
    import random
    import signal
    import time
    w = tmp_path / "w"
    shutil.copytree(world, w, symlinks=True)
    (w / "long.yaml").write_text(LONG_SUITE)
    argv = {"quantize": ["quantize", "model", "--recipe", "w4g64-head", "--out", "o"],
            "export": ["export", "art", "--out", "o"],
            "eval": ["eval", "art", "--suite", "long.yaml", "--out", "o"]}[kind]
    t0 = time.perf_counter()  # the reference: one uninterrupted run, into another folder
    p = _popen(argv[:-1] + ["ref"], w)
    assert p.wait() == 0, p.stderr.read()
    full = time.perf_counter() - t0
    reference = _outcome(kind, w, "ref")
    rng = random.Random(f"{kind}-{sig}")
    for attempt in range(3):  # three kills at random points of the run, each followed by a look at what is left
        p = _popen(argv, w)
        time.sleep(rng.uniform(0.2, 0.95) * full)
        p.send_signal(getattr(signal, sig))
        code = p.wait()
        assert code != 0 or (w / "o").exists()
        if kind != "eval":  # an artifact or export is all or nothing
            assert not (w / "o").exists() or _outcome(kind, w, "o") == reference
        if sig == "SIGINT":  # Ctrl-C cleans up after itself: no temporary left
            assert not [x for x in w.iterdir() if ".tmp-" in x.name], sorted(x.name for x in w.iterdir())
    p = _popen(argv + (["--force"] if kind != "eval" and (w / "o").exists() else []), w)  # resume / redo
    assert p.wait() == 0, p.stderr.read()
    assert _outcome(kind, w, "o") == reference
    assert not [x for x in w.iterdir() if ".tmp-" in x.name or ".old-" in x.name]  # SIGKILL's leftovers went too


def test_every_file_a_command_writes_follows_the_umask(world, tmp_path):
    """A serving process under another account must be able to read what qbench wrote (0644 under 022)."""
    w = tmp_path / "w"
    shutil.copytree(world, w, symlinks=True)
    old = os.umask(0o022)
    try:
        for argv in (["quantize", "model", "--recipe", "w8", "--out", "q"], ["export", "art", "--out", "e"],
                     ["eval", "art", "--suite", "suite.yaml", "--out", "r", "--baseline", "runs/fp"],
                     ["compare", "runs/fp", "r", "--out", "c"]):
            p = _popen(argv, w)
            assert p.wait() == 0, p.stderr.read()
    finally:
        os.umask(old)
    written = [p for d in ("q", "e", "r", "c") for p in [w / d, *(w / d).rglob("*")]]
    assert any(p.name == "model.safetensors" for p in written) and any(p.suffix == ".safetensors" and "parts" in
                                                                        p.parts for p in written)
    for p in written:
        want = 0o755 if p.is_dir() else 0o644
        assert p.stat().st_mode & 0o777 == want, (p, oct(p.stat().st_mode))
