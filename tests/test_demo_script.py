"""scripts/demo.sh, the main job's driver: a demo cut short continues in its runs folder (RUNS=) without
recomputing what it already holds, and a RUNS folder that does not exist is one line and exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, SMOL
from qbench.quant.quantize import source_commit

SUITE = f"""name: demo-mini
seed: 5
batch_size: 2
tasks:
  kld: {{data: {ROOT}/evals/data/wikitext-2-raw/wiki.test.raw, ctx: 64, chunks: 3, top_k: 16, exact_chunks: 1}}
"""


def demo(tmp_path, *variants, runs=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", QBENCH=str(Path(sys.executable).parent / "qbench"))
    env.pop("RUNS", None)
    if runs is not None:
        env["RUNS"] = str(runs)
    return subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), SMOL, str(tmp_path / "s.yaml"), "report",
                           *variants], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)


def results(run: Path) -> dict:
    rec = json.loads((run / "results.json").read_text())
    return {"tasks": rec["tasks"]["kld"]["kld"], "subject": rec["subject"]}


def test_an_interrupted_demo_continues_in_its_runs_folder(smollm2, tmp_path):
    (tmp_path / "s.yaml").write_text(SUITE)
    p = demo(tmp_path, "w8", "fp+kv4")
    assert p.returncode == 0, p.stderr[-3000:]
    runs, = (tmp_path / "artifacts" / "runs").iterdir()
    first = {v: results(runs / v) for v in ("w8", "fp+kv4")}
    # cut short in the K4V4 eval: its summary and one of its chunks were never written
    (runs / "fp+kv4" / "results.json").unlink()
    next((runs / "fp+kv4" / "parts").glob("*/chunk_00002.safetensors")).unlink()
    p = demo(tmp_path, "w8", "fp+kv4", runs=runs)
    assert p.returncode == 0, p.stderr[-3000:]
    assert list((tmp_path / "artifacts" / "runs").iterdir()) == [runs]  # the same folder, no new one
    assert {v: results(runs / v) for v in first} == first  # one chunk recomputed, to the same numbers
    def started_with(v):  # chunks each invocation found in the folder as it started
        lines = (runs / v / "segments.jsonl").read_text().splitlines()
        return [json.loads(x)["done_before"].get("chunks", 0) for x in lines]
    assert started_with("fp+kv4") == [0, 2] and started_with("w8") == [0, 3]  # only the lost chunk recomputed
    commit = source_commit()
    if commit and not commit.endswith("+dirty"):  # a clean checkout (CI's): the artifact is kept, not remade
        assert f"reusing artifacts/quant/{SMOL}/w8" in p.stderr
    report = (tmp_path / "report" / "report.md").read_text()
    assert "Machine: every run on " in report and "Different machines" not in report


def test_a_runs_folder_that_does_not_exist_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "s.yaml").write_text(SUITE)
    p = demo(tmp_path, "w8", runs=tmp_path / "nowhere")
    assert p.returncode == 2 and p.stderr.strip() == (f"RUNS={tmp_path / 'nowhere'}: no such folder; give the runs "
                                                      f"folder of the demo to continue, or unset RUNS")
    assert not (tmp_path / "artifacts").exists()
