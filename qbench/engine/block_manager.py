"""Physical KV blocks: a free list, a reference count per block, a block table per sequence.

Allocation happens only when a sequence crosses a block boundary, so a decode step
usually allocates nothing (the seeds: 1,000 tokens in 16-token blocks is 63 blocks, and
the 64th is needed only at token 1,009).
"""

from __future__ import annotations

from collections import deque

from qbench.engine.sequence import Sequence


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s table cover ``num_tokens`` tokens, allocating only at boundaries."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free} free")
        for _ in range(max(need, 0)):
            block = self.free_blocks.popleft()
            self.ref_count[block] = 1
            seq.block_table.append(block)

    def release(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks.append(block)
        seq.block_table.clear()
        seq.num_cached = 0
