"""How many KV blocks a request holds at most, and the pool a wave of requests needs.

Without eviction a request holds up to its whole reach (prompt plus new tokens). A request that evicts holds
its whole prompt while it prefills (every policy must see the prompt before choosing), then at most its budget
plus one block (engine/evictor.py). So a pool for evicting requests need not hold every reach: it holds each
request's budget plus one block, and room for the one whole prompt that prefills at a time. The continuous
scheduler keeps to that by reserving each request's blocks when it admits it (scheduler.py), so such a pool never
preempts an evicted request (whose recompute would choose its keep-set anew).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Footprint:
    steady: int  # blocks held at most once the prefill is done
    peak: int  # blocks held at most while it prefills (the whole prompt, before eviction)
    evicts: bool

    def admitted(self, forks: int) -> int:
        """Blocks to reserve for a request and its ``forks`` parallel samples, which share its evicted prompt
        and then each take up to ``steady`` blocks of their own."""
        return max(self.peak, self.steady * (1 + forks))


def footprint(prompt_len: int, reach: int, block_size: int, policy=None) -> Footprint:
    """``reach``: prompt plus new tokens, capped by the context window; ``policy``: a layers.eviction.Eviction or
    None. A request whose budget covers its reach never evicts and holds its reach."""
    full = -(-reach // block_size)
    keep = None if policy is None else policy.tokens(prompt_len)
    if keep is None or keep >= reach:
        return Footprint(full, full, False)
    steady = -(-min(reach, keep + block_size) // block_size)
    return Footprint(steady, max(steady, -(-prompt_len // block_size)), True)


def pool_blocks(footprints: list[Footprint], max_batch: int) -> int:
    """Blocks for the largest wave: the ``max_batch`` largest steady footprints, and room for one prompt beyond
    its own steady footprint at a time."""
    steady = sorted((f.steady for f in footprints), reverse=True)[:max_batch]
    return sum(steady) + max((f.peak - f.steady for f in footprints), default=0)
