"""Which qbench code computed a run's items.

A long eval is often interrupted and resumed, and the checkout can move between the two (a pull). Each
invocation appends one line to RUN/segments.jsonl as it starts: its commit and how many items and chunk
parts every task already had. Items are only ever appended, so the counts of consecutive lines say what each
invocation computed, even for one that was killed before it wrote results.json.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from qbench.evals.store import RunStore, append_line

SEGMENTS = "segments.jsonl"


def open_segment(store: RunStore, commit: str | None) -> None:
    """Record that an invocation of ``commit`` starts on this run folder (rank 0 only)."""
    if store.write:
        append_line(store.root / SEGMENTS, {"commit": commit, "done_before": store.counts(),
                                            "started": datetime.now(timezone.utc).isoformat(timespec="seconds")})


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
    """What each commit computed, in order: ``[{"commit", "computed": {task: n}}]``.

    Items stored before the folder kept segments (older qbench) appear first with commit None. Invocations
    that computed nothing (a rerun that only reloaded) are left out."""
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
        if out and out[-1]["commit"] == seg.get("commit"):  # resumed on the same code: one segment, as if never cut
            for t, n in computed.items():
                out[-1]["computed"][t] = out[-1]["computed"].get(t, 0) + n
        else:
            out.append({"commit": seg.get("commit"), "computed": computed})
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
