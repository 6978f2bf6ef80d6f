"""Physical KV blocks: a free list, a reference count per block, a block table per sequence.

Allocation happens only when a sequence crosses a block boundary, so a decode step
usually allocates nothing (the seeds: 1,000 tokens in 16-token blocks is 63 blocks, and
the 64th is needed only at token 1,009).

A block may be held by several owners at once: sequences forked from one prompt (parallel
sampling), and the prefix cache. Full blocks are immutable once shared. A write into a shared
partial block copies it first (copy-on-write); the writer that copies drops its reference, so
the last holder writes in place and only the first writer ever copies.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from qbench.engine.sequence import Sequence


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, copy_block: Callable[[int, int], None] | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.copy_block = copy_block  # (src, dst): copies one block's K/V in every layer
        self.copies = 0  # copy-on-write events, for tests and the bench

    def grow(self, num_blocks: int, copy_block: Callable[[int, int], None]) -> None:
        """The pool was reallocated larger with every block kept in place: the new ids are free."""
        self.free_blocks.extend(range(self.num_blocks, num_blocks))
        self.ref_count += [0] * (num_blocks - self.num_blocks)
        self.num_blocks, self.copy_block = num_blocks, copy_block

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise OutOfBlocks(f"no free block of {self.num_blocks}")
        block = self.free_blocks.popleft()
        self.ref_count[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"block {block} is free"
        self.ref_count[block] += 1

    def decref(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} released twice"
        if self.ref_count[block] == 0:
            self.free_blocks.append(block)

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s table cover its first ``num_tokens`` tokens (less those evicted), allocating only at
        boundaries."""
        need = self.blocks_for(num_tokens - seq.evicted) - len(seq.block_table)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free} free")
        for _ in range(max(need, 0)):
            seq.block_table.append(self.allocate())

    def blocks_to_write(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks a write of positions [num_cached, num_tokens) needs: new ones past the table, plus a
        copy of a shared partial block that the write starts in. Positions count evicted tokens; the cache
        holds them less ``seq.evicted``."""
        need = max(self.blocks_for(num_tokens - seq.evicted) - len(seq.block_table), 0)
        j = seq.kv_len // self.block_size
        if seq.kv_len % self.block_size and j < len(seq.block_table) and self.ref_count[seq.block_table[j]] > 1:
            need += 1
        return need

    def prepare_write(self, seq: Sequence, num_tokens: int) -> None:
        """Before writing positions [num_cached, num_tokens): copy a shared block the write lands in, then
        extend the table. Only a partial block can be written to; a full shared block is read-only."""
        if self.blocks_to_write(seq, num_tokens) > self.num_free:
            raise OutOfBlocks(f"need {self.blocks_to_write(seq, num_tokens)} blocks, {self.num_free} free")
        j = seq.kv_len // self.block_size
        if j < len(seq.block_table) and self.ref_count[seq.block_table[j]] > 1:
            assert seq.kv_len % self.block_size, "a full shared block is never written"
            old, new = seq.block_table[j], self.allocate()
            self.copy_block(old, new)
            self.decref(old)
            seq.block_table[j] = new
            self.copies += 1
        self.reserve(seq, num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (parallel sampling from one prompt)."""
        for block in parent.block_table:
            self.incref(block)
        child.block_table = list(parent.block_table)
        child.num_cached, child.evicted = parent.num_cached, parent.evicted

    def release(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.decref(block)
        seq.block_table.clear()
        seq.num_cached = seq.evicted = 0
