"""Data parallelism for evaluations: which items a rank owns, and gathering their results.

Items are dealt round-robin (item i to rank i mod p), so the split is deterministic and needs no
communication. Every rank gathers every result (``all_gather_object`` over gloo), so the task code
after a gather runs identically everywhere; only rank 0 writes files.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from qbench.errors import QBenchError


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1

    @classmethod
    def from_env(cls, required: bool = False) -> "Dist":
        """The process group torchrun describes in the environment (gloo, CPU); one process without it."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            if required:
                raise QBenchError("this runs on several processes: launch it with torchrun --nproc-per-node N -m "
                                  "qbench ... (see the README, 'Running on several processes or machines')")
            return cls()
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, n: int) -> list[int]:
        """Indices of ``n`` items this rank computes."""
        return list(range(self.rank, n, self.world))

    def gather(self, local: list[tuple[int, Any]], n: int) -> list[Any]:
        """(index, result) pairs from every rank -> the n results in index order, on every rank."""
        parts = [local]
        if self.world > 1:
            import torch.distributed as dist
            parts = [None] * self.world
            dist.all_gather_object(parts, local)
        out: list[Any] = [None] * n
        for part in parts:
            for i, r in part:
                out[i] = r
        return out

    def map(self, items: Sequence, fn: Callable[[list], list], batch: int) -> list:
        """``fn`` over this rank's items in batches of ``batch`` -> every item's result, on every rank."""
        idx = self.mine(len(items))
        local = []
        for s in range(0, len(idx), batch):
            chunk = idx[s: s + batch]
            local += list(zip(chunk, fn([items[i] for i in chunk])))
        return self.gather(local, len(items))

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()

    @staticmethod
    def leave() -> None:
        """Ends a torchrun rank whose work is done and whose files are written and closed, without running the
        C++ static destructors: even after close(), a rank of `bench --tp` aborted there twice in CI
        ("terminate called without an active exception", after the report was written), and torchrun then
        failed the whole run."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def close(self) -> None:
        """Every rank meets, then tears its process group down. A rank that simply exits while another
        still holds the group can abort in gloo's teardown ("terminate called without an active
        exception"), and torchrun then reports the whole run failed."""
        if self.world > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
