"""Radix-tree prefix cache over KV blocks (SGLang's RadixAttention, block-granular).

Each edge holds whole blocks: its tokens (a multiple of the block size) and one physical block
per ``block_size`` tokens. Children are keyed by the tokens of their first block, so two edges
out of a node always differ inside their first block. A lookup returns the longest cached prefix
in whole blocks and splits an edge where the lookup diverges inside it.

The cache holds one reference on every block it stores. A node in use by a running request is
pinned (``lock`` > 0 on it and every ancestor); eviction takes unpinned leaves only, least recently
used first, and a parent whose last child goes becomes a candidate at once.

With a cache salt (one per tenant), lookups and inserts happen under that salt's own root: a hit
can only come from the same tenant's prompts, so timing cannot reveal another tenant's prompt.
"""

from __future__ import annotations

import heapq
import itertools

from qbench.engine.block_manager import BlockManager


class Node:
    __slots__ = ("key", "blocks", "children", "parent", "lock", "last_used")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: "Node | None"):
        self.key = key  # edge tokens from the parent, len(blocks) * block_size of them
        self.blocks = blocks
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.lock = 0
        self.last_used = 0


class RadixCache:
    def __init__(self, blocks: BlockManager):
        self.bm = blocks
        self.bs = blocks.block_size
        self.roots: dict[str, Node] = {}
        self._clock = itertools.count(1)
        self.evicted_blocks = 0

    def _root(self, salt: str) -> Node:
        if salt not in self.roots:
            self.roots[salt] = Node((), [], None)
        return self.roots[salt]

    def _split(self, node: Node, nblocks: int) -> Node:
        """Cut ``node``'s edge after ``nblocks`` blocks; returns the new upper part."""
        bs = self.bs
        upper = Node(node.key[: nblocks * bs], node.blocks[:nblocks], node.parent)
        upper.lock, upper.last_used = node.lock, node.last_used
        node.parent.children[node.key[:bs]] = upper
        node.key, node.blocks, node.parent = node.key[nblocks * bs:], node.blocks[nblocks:], upper
        upper.children[node.key[:bs]] = node
        return upper

    def _walk(self, tokens: list[int], salt: str) -> tuple[Node, list[int]]:
        """The deepest node whose path is a whole-block prefix of ``tokens``, splitting a partly matched edge."""
        bs = self.bs
        node, blocks, pos, now = self._root(salt), [], 0, next(self._clock)
        node.last_used = now
        while pos + bs <= len(tokens):
            child = node.children.get(tuple(tokens[pos: pos + bs]))
            if child is None:
                break
            n = 1
            while n < len(child.blocks) and tuple(tokens[pos + n * bs: pos + (n + 1) * bs]) == \
                    child.key[n * bs: (n + 1) * bs]:
                n += 1
            if n < len(child.blocks):
                child = self._split(child, n)
            child.last_used = now
            blocks += child.blocks
            pos += n * bs
            node = child
        return node, blocks

    def match(self, tokens: list[int], salt: str = "") -> tuple[Node, list[int]]:
        """Longest cached whole-block prefix of ``tokens`` -> (its last node, pinned; its blocks)."""
        node, blocks = self._walk(tokens, salt)
        self.lock(node)
        return node, blocks

    def lock(self, node: Node) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock -= 1
            assert node.lock >= 0
            node = node.parent

    def insert(self, tokens: list[int], blocks: list[int], salt: str = "") -> Node:
        """Cache the whole blocks of ``tokens`` (``blocks`` hold their K/V). Blocks already cached for the
        same tokens are kept and the caller's copies are not adopted. Returns the node that ends the
        cached path (not pinned)."""
        n = min(len(tokens) // self.bs, len(blocks))
        tokens, blocks = tokens[: n * self.bs], blocks[:n]
        node, have = self._walk(tokens, salt)
        if len(have) == n:
            return node
        rest = blocks[len(have):]
        leaf = Node(tuple(tokens[len(have) * self.bs:]), list(rest), node)
        leaf.last_used = node.last_used
        node.children[leaf.key[: self.bs]] = leaf
        for b in rest:
            self.bm.incref(b)
        return leaf

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` blocks if unpinned leaves allow; returns the blocks freed."""
        if num_blocks <= 0:
            return 0
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n.lock == 0
                  and n.parent is not None]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num_blocks:
            _, _, node = heapq.heappop(leaves)
            before = self.bm.num_free
            for b in node.blocks:
                self.bm.decref(b)
            freed += self.bm.num_free - before
            self.evicted_blocks += len(node.blocks)
            parent = node.parent
            del parent.children[node.key[: self.bs]]
            if not parent.children and parent.lock == 0 and parent.parent is not None:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return freed

    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    @property
    def cached_blocks(self) -> int:
        return sum(len(n.blocks) for n in self._nodes())

    def clear(self) -> None:
        """Drop every unpinned entry."""
        self.evict(self.bm.num_blocks + 1)
