"""scripts/check_speed.py decides which README speed claims apply on this CPU (no timing here: the bench
itself runs in .ci/run, after the tests)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_speed", ROOT / "scripts" / "check_speed.py")
check_speed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_speed)

AVX2 = {"model": "m", "cpu_flags": ["avx2", "fma"], "cpu_lacks": ["avx512f"]}


def test_a_claim_applies_only_where_every_flag_is_present_and_no_excluded_one():
    assert check_speed.not_applicable(AVX2, {"avx2", "fma", "f16c"}) is None
    assert "lacks fma" in check_speed.not_applicable(AVX2, {"avx2"})
    # an AVX-512 CPU also has AVX2 and FMA: the AVX2-only claim must not be checked there
    assert "without avx512f" in check_speed.not_applicable(AVX2, {"avx2", "fma", "avx512f"})
    assert check_speed.not_applicable({"cpu_flags": ["avx2"]}, {"avx2", "avx512f"}) is None


def test_every_shipped_claim_is_well_formed_and_the_machine_kinds_do_not_overlap():
    spec = yaml.safe_load((ROOT / "scripts" / "speed_claims.yaml").read_text())
    kinds = {}
    for claim in spec["claims"]:
        assert set(claim) <= check_speed.CLAIM_KEYS
        assert 0 < claim.get("margin", spec["margin"]) < 0.5
        assert claim["over_fp32_engine"] and all(v > 1.0 for v in claim["over_fp32_engine"].values())
        kinds.setdefault(claim["model"], []).append(claim)
    # no CPU may fall under two claims for one model at one batch: their ratios were measured on different kinds
    for model, claims in kinds.items():
        for a in claims:
            for b in claims:
                if a is not b and a["batch"] == b["batch"]:
                    assert set(a.get("cpu_lacks", [])) & set(b["cpu_flags"]) or \
                        set(b.get("cpu_lacks", [])) & set(a["cpu_flags"]), (model, a, b)


def test_a_misspelt_field_is_refused_with_exit_2_before_any_claim_runs(tmp_path):
    bad = tmp_path / "claims.yaml"
    runs_here = {"model": "smollm2-135m-instruct", "cpu_flags": [], "batch": 1, "prompt_len": 8, "gen_len": 8,
                 "over_fp32_engine": {"w8": 1.5}}
    bad.write_text(yaml.safe_dump({"margin": 0.2, "claims": [runs_here, {**AVX2, "cpu_lack": ["x"], "batch": 1,
                                                                          "over_fp32_engine": {"w8": 1.5}}]}))
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_speed.py"), "--claims", str(bad)],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert "claims[1]" in p.stderr and "cpu_lack" in p.stderr and str(bad) in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert "machine:" not in p.stdout  # refused before the first claim's bench, not after it


def test_rounds_that_are_not_a_whole_number_of_at_least_one_are_refused_before_any_claim(tmp_path):
    for rounds in (0, 2.5, "3", True):
        bad = tmp_path / "claims.yaml"
        bad.write_text(yaml.safe_dump({"margin": 0.2, "rounds": rounds, "claims": [
            {"model": "smollm2-135m-instruct", "cpu_flags": [], "batch": 1, "prompt_len": 8, "gen_len": 8,
             "over_fp32_engine": {"w8": 1.5}}]}))
        p = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_speed.py"), "--claims", str(bad)],
                           capture_output=True, text=True)
        assert p.returncode == 2 and "rounds" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "machine:" not in p.stdout


def test_a_claim_for_another_cpu_is_skipped_and_said(tmp_path):
    other = tmp_path / "claims.yaml"
    other.write_text(yaml.safe_dump({"margin": 0.2, "claims": [
        {"model": "smollm2-135m-instruct", "cpu_flags": ["no_such_flag"], "batch": 1, "prompt_len": 8,
         "gen_len": 8, "over_fp32_engine": {"w8": 1.5}}]}))
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_speed.py"), "--claims", str(other)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "lacks no_such_flag" in p.stdout and "no claim applies here" in p.stdout
