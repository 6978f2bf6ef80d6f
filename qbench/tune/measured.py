"""Running `qbench sensitivity` and reading its file back: the fp model, the seeded calibration windows and the
measured rows, with what they were measured on, so that `qbench tune` can refuse a file from another model,
unit or text."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qbench.errors import QBenchError
from qbench.tune.reference import Reference
from qbench.tune.sensitivity import Scheme, Unit, fixed_bytes, measure, units

WRITER = "qbench sensitivity"
CALIBRATION_TEXT = "evals/data/wikitext-2-raw/wiki.valid.raw"


@dataclass
class Loaded:
    folder: Path
    model: object  # CausalLM, fp32
    tokenizer: object
    source_sha256: str


def load_fp(model_spec: str) -> Loaded:
    from qbench.engine.api import load_tokenizer
    from qbench.models.registry import load_model
    from qbench.models.zoo import resolve_model
    from qbench.quant.artifact import is_artifact
    from qbench.quant.quantize import source_sha256

    folder = resolve_model(model_spec)
    if is_artifact(folder):
        raise QBenchError(f"{model_spec}: a quantized artifact; give the fp source model, whose units are then "
                          f"quantized one at a time")
    return Loaded(folder, load_model(folder, torch.float32), load_tokenizer(folder), source_sha256(folder))


def search_windows(tokenizer, samples: int, seq_len: int, seed: int) -> tuple[torch.Tensor, dict]:
    """The seeded WikiText-2 valid windows the sensitivities and the search are measured on."""
    from qbench.quant.calibration import calibration_windows
    from qbench.quant.recipe import Calibration
    for name, v in (("--samples", samples), ("--seq-len", seq_len)):
        if v < 1:
            raise QBenchError(f"{name} {v}: must be a positive integer")
    if seq_len < 8 or seq_len % 2:
        raise QBenchError(f"--seq-len {seq_len}: must be an even number >= 8 (its second half is scored)")
    return calibration_windows(tokenizer, Calibration(CALIBRATION_TEXT, samples, seq_len, seed))


def measure_all(fp: Loaded, schemes: list[Scheme], unit: str, windows: torch.Tensor, log=print,
                ref: Reference | None = None) -> dict:
    """The sensitivity rows of every unit, with the bytes the other weights take."""
    t0 = time.perf_counter()
    unit_list = units(fp.model, unit)
    ref = Reference(fp.model, windows) if ref is None else ref
    log(f"fp reference: {windows.shape[0]} windows of {windows.shape[1]} tokens, {ref.tokens} scored tokens "
        f"({time.perf_counter() - t0:.0f}s); measuring {len(unit_list)} units x "
        f"{sum(not s.fp for s in schemes)} schemes")
    rows = measure(fp.model, ref, unit_list, schemes, log)
    names = [p for u in unit_list for p in u.linears]
    return {"rows": rows, "fixed_bytes": fixed_bytes(fp.model, names), "scored_tokens": ref.tokens,
            "seconds": round(time.perf_counter() - t0, 1)}


def read_sensitivity(path: Path, fp: Loaded, unit: str, schemes: list[Scheme], windows_record: dict) -> dict:
    """A sensitivity file, checked against the model, unit, schemes and windows it is about to serve."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise QBenchError(f"{path}: cannot read a sensitivity file ({e}); give a file `qbench sensitivity` wrote") \
            from None
    from qbench.paths import STAMP
    if not isinstance(data, dict) or data.get(STAMP) != WRITER:
        raise QBenchError(f"{path}: not a file `qbench sensitivity` wrote")
    problems = []
    if data.get("source_sha256") != fp.source_sha256:
        problems.append(f"it was measured on another model ({data.get('model')})")
    if data.get("unit") != unit:
        problems.append(f"its unit is {data.get('unit')}, not {unit} (set --unit {data.get('unit')})")
    missing = [s.name for s in schemes if not s.fp and s.name not in data.get("schemes", [])]
    if missing:
        problems.append(f"it has no measurement for {', '.join(missing)}")
    if {k: data.get("windows", {}).get(k) for k in ("data", "samples", "seq_len", "seed", "window_starts")} != \
            {k: windows_record.get(k) for k in ("data", "samples", "seq_len", "seed", "window_starts")}:
        problems.append("it was measured on other calibration windows (--samples, --seq-len, --seed)")
    if problems:
        raise QBenchError(f"{path}: {'; '.join(problems)}; measure again with `qbench sensitivity`")
    for r in data["rows"]:
        for s in schemes:
            if s.fp:
                r["kld"][s.name], r["dnll"][s.name] = {"mean": 0.0, "se": 0.0}, {"mean": 0.0, "se": 0.0}
                r["bytes"][s.name] = r["params"] * 4
    return data


def run_sensitivity(model_spec: str, schemes: list[Scheme], unit: str, out: Path, samples: int, seq_len: int,
                    seed: int, log=print) -> dict:
    from qbench.tune.output import check_report, write_report
    out = Path(out)
    fig_path = out.with_suffix(".png")
    check_report(out, fig_path, WRITER)  # before the long work
    if all(s.fp for s in schemes):
        raise QBenchError("--schemes: give at least one quantized scheme (fp is the reference)")
    fp = load_fp(model_spec)
    units(fp.model, unit)  # the unit name, checked before the windows are tokenized
    windows, record = search_windows(fp.tokenizer, samples, seq_len, seed)
    measured = measure_all(fp, schemes, unit, windows, log)
    report = {"model": model_spec, "source_sha256": fp.source_sha256, "unit": unit,
              "schemes": [s.name for s in schemes if not s.fp], "windows": record,
              "method": "round to nearest, each unit alone, fake-quantized in the fp model; full-vocabulary KLD on "
                        "the second half of each window", "figure": fig_path.name, **measured}
    from qbench.tune.figures import sensitivity_figure
    fig = sensitivity_figure(measured["rows"], schemes, f"{model_spec}: sensitivity per {unit} "
                 f"({measured['scored_tokens']} scored WikiText-2 valid tokens)")
    check_report(out, fig_path, WRITER)
    write_report(out, report, WRITER, fig, fig_path)
    return report


def unit_list_for(model, unit: str) -> dict[str, Unit]:
    return {u.name: u for u in units(model, unit)}
