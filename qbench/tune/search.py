"""The search, as pure functions over measured sensitivities: a greedy multiple-choice knapsack that buys the
largest measured loss reduction per byte until the predicted loss fits the budget, then gives back bytes where
that keeps the prediction inside it; and the Pareto frontier of measured (bytes, loss) points.

The prediction assumes that the losses of units quantized together add up; the caller verifies every choice with
a real evaluation and tightens the target when the sum was optimistic.
"""

from __future__ import annotations


def predicted(rows: list[dict], choice: dict[str, str], metric: str) -> float:
    return sum(r[metric][choice[r["unit"]]]["mean"] for r in rows)


def total_bytes(rows: list[dict], choice: dict[str, str], fixed: int) -> int:
    return fixed + sum(r["bytes"][choice[r["unit"]]] for r in rows)


def greedy(rows: list[dict], schemes: list[str], target: float, metric: str = "kld") -> dict[str, str]:
    """unit -> scheme name minimising bytes such that the sum of the units' measured ``metric`` <= ``target``
    (or the most accurate choice, when no choice fits)."""
    cost = {r["unit"]: {s: r[metric][s]["mean"] for s in schemes} for r in rows}
    size = {r["unit"]: r["bytes"] for r in rows}
    # ties in bytes go to the lower loss; ties in both to the order of ``schemes`` (deterministic)
    choice = {u: min(schemes, key=lambda s: (size[u][s], cost[u][s], schemes.index(s))) for u in cost}
    loss = sum(cost[u][choice[u]] for u in cost)
    while loss > target:
        best = None
        for u in cost:
            for s in schemes:
                extra, gain = size[u][s] - size[u][choice[u]], cost[u][choice[u]] - cost[u][s]
                if extra <= 0 or gain <= 0:
                    continue
                key = (gain / extra, gain)
                if best is None or key > best[0]:
                    best = (key, u, s)
        if best is None:
            break  # nothing left that lowers the loss
        _, u, s = best
        loss += cost[u][s] - cost[u][choice[u]]
        choice[u] = s
    # give back bytes where the prediction stays within the target: the largest saving first
    moves = sorted(((size[u][choice[u]] - size[u][s], u, s) for u in cost for s in schemes
                    if size[u][s] < size[u][choice[u]]), reverse=True)
    for saving, u, s in moves:
        if size[u][s] >= size[u][choice[u]]:
            continue  # this unit already moved
        new = loss + cost[u][s] - cost[u][choice[u]]
        if new <= target:
            loss, choice[u] = new, s
    return choice


def frontier(points: list[dict]) -> list[dict]:
    """The points no other point beats on both bytes and loss, ordered by bytes."""
    pts = sorted(points, key=lambda p: (p["bytes"], p["loss"]))
    out = []
    for p in pts:
        if not out or p["loss"] < out[-1]["loss"]:
            out.append(p)
    return out


def lower_hull(points: list[dict]) -> list[dict]:
    """The lower convex hull of (bytes, loss): what mixing two uniform recipes unit by unit in proportion would
    reach if the units' losses added up (a mix of fraction w of one and 1 - w of the other lies on the segment)."""
    out: list[dict] = []
    for p in frontier(points):
        while len(out) >= 2:
            a, b = out[-2], out[-1]
            # b lies on or above the segment a-p: drop it
            if (b["loss"] - a["loss"]) * (p["bytes"] - a["bytes"]) >= (p["loss"] - a["loss"]) * (b["bytes"] - a["bytes"]):
                out.pop()
            else:
                break
        out.append(p)
    return out


def hull_weights(hull: list[dict], nbytes: int) -> list[tuple[dict, float]] | None:
    """The hull's loss at ``nbytes`` as weights on its two neighbouring points; None outside its range."""
    if not hull or nbytes < hull[0]["bytes"] or nbytes > hull[-1]["bytes"]:
        return None
    for a, b in zip(hull, hull[1:]):
        if a["bytes"] <= nbytes <= b["bytes"]:
            w = (b["bytes"] - nbytes) / (b["bytes"] - a["bytes"])
            return [(a, w), (b, 1 - w)]
    return [(hull[0], 1.0)]
