"""Which qbench code, on which machine, computed a run's items.

A long eval is often interrupted and resumed, and the checkout can move between the two (a pull), or the
run folder can move to another machine. Each invocation appends one line to RUN/segments.jsonl as it starts:
its commit, the machine it runs on (CPU, kernel path, ATen's capability, threads, torch) and how many items
and chunk parts every task already had. Items are only ever appended, so the counts of consecutive lines say
what each invocation computed, even for one that was killed before it wrote results.json. The machine
matters beside the commit: speed is each machine's, and a quantized KV cache or a generated answer can move
with the last bits that another instruction set gives (README, "What reproduces").
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from qbench.evals.store import RunStore, append_line

SEGMENTS = "segments.jsonl"


MACHINE_KEYS = ("cpu", "kernels", "aten", "threads", "torch")


def machine_key(m: dict | None) -> dict | None:
    """The fields of a machine record that decide what a run computes and how fast: two invocations with the
    same ones count as one machine."""
    return None if not m else {k: m.get(k) for k in MACHINE_KEYS if m.get(k) is not None}


def open_segment(store: RunStore, commit: str | None, machine: dict | None = None) -> None:
    """Record that an invocation of ``commit`` starts on this run folder, on ``machine`` (rank 0 only)."""
    if store.write:
        line = {"commit": commit, "done_before": store.counts(),
                "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        if machine:
            line["machine"] = machine_key(machine)
        append_line(store.root / SEGMENTS, line)


def read_segments(store: RunStore) -> list[dict]:
    path = store.root / SEGMENTS
    out = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # torn by an interrupt: the next line's counts still bound what was computed
    return out


def code_segments(store: RunStore) -> list[dict]:
    """What each commit computed, in order: ``[{"commit", "machine", "computed": {task: n}}]`` (``machine``
    only where the invocation recorded one).

    Items stored before the folder kept segments (older qbench) appear first with commit None. Invocations
    that computed nothing (a rerun that only reloaded) are left out; consecutive ones of one commit on one
    machine count as one."""
    segs = read_segments(store)
    bounds = [s.get("done_before", {}) for s in segs] + [store.counts()]
    out: list[dict] = []
    first = bounds[0]
    if segs and any(first.values()):
        out.append({"commit": None, "computed": {t: n for t, n in first.items() if n}})
    for seg, lo, hi in zip(segs, bounds, bounds[1:]):
        computed = {t: hi.get(t, 0) - lo.get(t, 0) for t in hi if hi.get(t, 0) > lo.get(t, 0)}
        if not computed:
            continue
        here = {"commit": seg.get("commit")}
        if seg.get("machine"):
            here["machine"] = seg["machine"]
        if out and {k: v for k, v in out[-1].items() if k != "computed"} == here:
            for t, n in computed.items():  # resumed on the same code and machine: one segment, as if never cut
                out[-1]["computed"][t] = out[-1]["computed"].get(t, 0) + n
        else:
            out.append(dict(here, computed=computed))
    return out


def commits_of(record: dict) -> list[str | None]:
    """The commits that computed a run, oldest first; one entry (possibly None) for a run without segments."""
    segs = record.get("versions", {}).get("code_segments")
    if not segs:
        return [record.get("versions", {}).get("qbench_commit")]
    seen: list[str | None] = []
    for s in segs:
        if s["commit"] not in seen:
            seen.append(s["commit"])
    return seen


def machines_of(record: dict) -> list[dict]:
    """The machines that computed a run, oldest first (``machine_key`` records). A run from before segments kept
    machines has the one its results.json names; none when nothing was recorded."""
    seen: list[dict] = []
    for s in record.get("versions", {}).get("code_segments") or []:
        if s.get("machine") and s["machine"] not in seen:
            seen.append(s["machine"])
    if not seen and machine_key(record.get("machine")):
        seen.append(machine_key(record["machine"]))
    return seen
