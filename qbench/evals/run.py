"""`qbench eval MODEL_OR_ARTIFACT --suite S --out RUN [--baseline RUN]`: run a suite, resumably.

A run folder is created with ``run.json`` (what is being evaluated, under which suite) before any task
runs; tasks write per-item records as they go; ``results.json`` is written last and atomically. Re-running
the same command into the same folder picks up from the records. A baseline must have been made under
the same suite (same tasks, sizes and seed, compared by hash).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from qbench.errors import QBenchError
from qbench.inputs import read_json_object, read_text
from qbench.evals.invariance import compare_runs, same_subject
from qbench.evals.store import RunStore
from qbench.evals.suite import DATA_FIELDS, Suite, load_suite
from qbench.kernels.build import machine
from qbench.paths import atomic_write_text, refuse_file_above


@dataclass
class RunContext:
    store: RunStore
    base_store: RunStore | None
    seed: int
    suite_path: str


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def read_record(path: Path, fix: str) -> dict:
    """A finished run's results.json; ``fix`` says what to do when it is missing or broken."""
    res = Path(path) / "results.json"
    if not res.is_file():
        raise QBenchError(f"{path}: not a finished qbench eval run (no results.json); {fix}")
    rec = read_json_object(res, "run record")
    for key in ("suite", "subject", "tasks"):
        if not isinstance(rec.get(key), dict):
            raise QBenchError(f"{res}: the run record has no {key!r} mapping; it was not written by qbench eval or "
                              f"was damaged; {fix}")
    return rec


def read_baseline(path: Path, suite: Suite) -> dict:
    base = read_record(path, "run the baseline first")
    b = base.get("suite", {})
    if b.get("hash") != suite.hash or b.get("seed") != suite.seed:
        raise QBenchError(f"{path}: the baseline was made under suite {b.get('name')!r} (hash {b.get('hash')}, seed "
                          f"{b.get('seed')}), this run uses {suite.name!r} (hash {suite.hash}, seed {suite.seed}); "
                          f"re-run the baseline with this suite")
    return base


def check_data_files(suite: Suite) -> None:
    """Every task's local data file exists, checked before anything is loaded or written. A name that is
    not a file path may be a hub data set, which only the task itself can try (when the hub is online)."""
    from qbench.evals.data import DataError, resolve
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    for name, cfg in suite.tasks.items():
        for field in DATA_FIELDS:
            spec = getattr(cfg, field, None)
            path = resolve(spec) if spec else None
            if path is not None:
                read_text(path, "data file", DataError)  # a decoding error named now, not mid-run
                continue
            if not spec:
                continue
            if offline or spec.endswith((".jsonl", ".json", ".txt", ".raw")):
                raise DataError(f"{suite.path}: tasks.{name}.{field}: data file {spec} not found; give a local "
                                f"file (the shipped ones are under evals/data/)")


def run_eval(model: str, suite_path: str, out: Path, baseline: Path | None = None, batch_size: int | None = None,
             kv: str | None = None, log=print, prefix_cache: bool = True, distributed: bool = False) -> dict:
    """Score ``model`` on a suite. Under torchrun (or with ``distributed``) the items of every task are
    dealt across the ranks and gathered; rank 0 writes the run, which equals a one-process run's."""
    from qbench.dist.comm import Dist
    from qbench.evals.provenance import code_segments, open_segment
    from qbench.evals.subject import Subject
    from qbench.evals.tasks import TASKS
    from qbench.quant.quantize import source_commit, versions
    from qbench.quant.recipe import load_kv_scheme

    if batch_size is not None and batch_size < 1:
        raise QBenchError(f"--batch-size {batch_size}: must be a positive integer")
    suite = load_suite(suite_path)
    check_data_files(suite)
    check_run_folder(Path(out))
    base = None if baseline is None else read_baseline(baseline, suite)
    bs = batch_size or suite.batch_size
    dist = Dist.from_env(required=distributed)
    if not dist.main:
        log = _quiet
    subject = Subject(model, bs, None if kv is None else load_kv_scheme(kv), prefix_cache=prefix_cache, dist=dist)
    out = Path(out)
    header = {"suite": dict(suite.to_dict(), hash=suite.hash, path=suite.path), "subject": subject.describe(),
              "baseline": None if baseline is None else str(baseline), "batch_size": bs,
              "prefix_cache": subject.engine.prefix_cache}
    if dist.main:
        _claim(out, header)
    dist.barrier()  # every rank reads what the run folder already holds (a resumed run) only once it is claimed
    store = RunStore(out, write=dist.main)
    ctx = RunContext(store, None if baseline is None else RunStore(baseline), suite.seed, suite.path)
    results, task_seconds = {}, {}
    t0 = time.perf_counter()
    # read before any task runs: the checkout may move (a pull) while a long eval computes
    commit = source_commit()
    here = dict(machine(), processes=dist.world)
    open_segment(store, commit, here)
    for name, cfg in suite.tasks.items():
        log(f"{name} ...")
        seed_everything(suite.seed)
        t1 = time.perf_counter()
        results[name] = TASKS[name].run(subject, cfg, ctx)
        task_seconds[name] = time.perf_counter() - t1
    # wall time of this invocation per task: a resumed run counts only what it computed
    record = dict(header, tasks=results, versions=dict(versions(), qbench_commit=commit,
                                                         code_segments=code_segments(store)),
                  seconds=time.perf_counter() - t0, task_seconds=task_seconds,
                  machine=here,
                  finished=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    dist.close()  # every collective is done; what follows is rank 0's writing
    if not dist.main:
        return record
    if base is not None and same_subject(record, base):
        record["batch_invariance"] = compare_runs(record, out, base, Path(baseline))
    atomic_write_text(out / "results.json", json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def _quiet(*_a, **_k) -> None:
    pass


def check_run_folder(out: Path) -> None:
    """Before any work: ``out`` is new, empty, or a run folder (resumed if it was made by the same command)."""
    refuse_file_above(out)
    if out.exists() and not (out / "run.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        raise QBenchError(f"{out}: exists and is not a qbench eval run; choose another --out")


def _claim(out: Path, header: dict) -> None:
    """Start a run folder, or resume one made by the same command; refuse one made by another."""
    run = out / "run.json"
    if run.is_file():
        old = read_json_object(run, "run header")
        def key(h):  # one baseline named two ways (relative, then absolute: RUNS=/abs/path) is one baseline
            base = h.get("baseline")
            return dict({k: h.get(k) for k in ("suite", "subject", "batch_size", "prefix_cache")},
                        baseline=None if base is None else os.path.realpath(base))
        if key(old) != key(header):
            raise QBenchError(f"{out}: holds a run of another model, suite, baseline, batch size or prefix-cache "
                              f"setting; choose another "
                              f"--out or delete it")
        return
    check_run_folder(out)
    atomic_write_text(run, json.dumps(header, indent=2, sort_keys=True) + "\n")
