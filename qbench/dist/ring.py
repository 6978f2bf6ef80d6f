"""Ring all-reduce over point-to-point send and receive, as the seeds describe it.

The buffer is cut into p chunks. Reduce-scatter: in each of p - 1 steps every rank sends one chunk to
its right neighbour and adds the chunk arriving from its left; afterwards rank r holds the full sum of
chunk (r + 1) mod p. All-gather: p - 1 more steps pass the finished chunks around the ring. Each rank
sends 2 (p - 1) / p of the buffer in 2 (p - 1) dependent steps: the bytes approach twice the buffer
whatever p is, and the step count is what grows (and what costs at decode sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RingStats:
    calls: int = 0
    steps: int = 0  # sequential send/receive steps
    bytes_sent: int = 0  # by this rank


def ring_all_reduce(t: torch.Tensor, stats: RingStats | None = None, group=None) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group`` in place (``t`` must be contiguous); returns ``t``."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    if stats is not None:
        stats.calls += 1
    if p == 1:
        return t
    if not t.is_contiguous():
        raise ValueError("ring_all_reduce: the tensor must be contiguous")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(p))
    right, left = ranks[(r + 1) % p], ranks[(r - 1) % p]
    chunks = list(t.view(-1).tensor_split(p))  # views into t
    scratch = torch.empty_like(chunks[0])

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        req = dist.isend(send, right, group=group)
        dist.recv(recv, left, group=group)
        req.wait()
        if stats is not None:
            stats.steps += 1
            stats.bytes_sent += send.nbytes

    for s in range(p - 1):  # reduce-scatter
        out, into = chunks[(r - s) % p], chunks[(r - s - 1) % p]
        got = scratch[: into.numel()]
        exchange(out, got)
        into.add_(got)
    for s in range(p - 1):  # all-gather: rank r starts with its finished chunk (r + 1) mod p
        exchange(chunks[(r + 1 - s) % p], chunks[(r - s) % p])
    return t


def expected_traffic(numel: int, itemsize: int, p: int) -> dict:
    """The seeds' arithmetic: bytes each rank sends and the sequential steps, for one all-reduce."""
    chunk = -(-numel // p)  # tensor_split gives the first chunks one element more when p does not divide
    return {"steps": 2 * (p - 1), "bytes_sent_ideal": 2 * (p - 1) / p * numel * itemsize,
            "bytes_sent_max": 2 * (p - 1) * chunk * itemsize}


class Collective:
    """The collectives a tensor-parallel model needs, over the backend's own all-reduce or the ring above."""

    KINDS = ("backend", "ring")

    def __init__(self, kind: str = "backend", group=None):
        if kind not in self.KINDS:
            raise ValueError(f"all-reduce {kind!r}: choose one of {', '.join(self.KINDS)}")
        self.kind, self.group = kind, group
        self.world = dist.get_world_size(group)
        self.stats = RingStats()  # ring traffic (the backend's is not observable from here)
        self.all_reduces = 0
        self.all_reduce_bytes = 0  # buffer bytes handed to all-reduce

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.all_reduces += 1
        self.all_reduce_bytes += t.nbytes
        if self.kind == "ring":
            return ring_all_reduce(t, self.stats, self.group)
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Each rank's (..., sizes[rank]) -> (..., sum(sizes)) on every rank, in rank order."""
        width = max(sizes)
        pad = torch.nn.functional.pad(t, (0, width - t.shape[-1])).contiguous()
        parts = [torch.empty_like(pad) for _ in sizes]
        dist.all_gather(parts, pad, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)
