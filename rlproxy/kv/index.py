"""Which stored prefix-cache entries share the most of a prompt: the index over entry keys.

Every entry's key (kv_blobs.Entry) carries its namespace, its chained block hashes and the hashes
of its turn boundaries, so the index is rebuilt from diskcache's keys alone at start. A lookup
finds the entries sharing the deepest whole block with the prompt, then lets an exact turn
boundary inside the next block beat the block. The index holds no KV and does no IO; the store
(kv/prefix_cache.py) calls it with its lock held.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from rlproxy.kv.blobs import Entry, end_hash


class BlockIndex:
    def __init__(self, block: int):
        self.block = block
        self.entries: dict[str, Entry] = {}
        self._by_block: dict[str, set[str]] = {}  # block hash -> keys of entries containing it
        self._short: dict[str, set[str]] = {}  # ns -> keys with a boundary inside the 1st block
        self._memory_only: set[str] = set()  # entries larger than the whole disk budget
        self._seq = 0

    def add(self, e: Entry, memory_only: bool = False) -> None:
        self.touch(e)
        self.entries[e.key] = e
        for h in e.blocks:
            self._by_block.setdefault(h, set()).add(e.key)
        if e.ends[0][0] < self.block:
            self._short.setdefault(e.ns, set()).add(e.key)
        if memory_only:
            self._memory_only.add(e.key)

    def touch(self, e: Entry) -> None:
        """Recency: written or read now (newer wins ties and stays longer under the budget)."""
        self._seq += 1
        e.seq = self._seq

    def drop(self, key: str) -> None:
        e = self.entries.pop(key, None)
        self._memory_only.discard(key)
        if e is None:
            return
        for h in e.blocks:
            keys = self._by_block.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_block[h]
        self._short.get(e.ns, set()).discard(key)

    def rank(self, ns: str, prompt: np.ndarray, hashes: list[str]) -> list[tuple[int, int, str]]:
        """Candidate entries of NS, best first: (tokens known to match, recency, key)."""
        level, keys = 0, self._short.get(ns, set())
        for k in range(len(hashes) - 1, 0, -1):  # the deepest block any entry shares
            if hashes[k] in self._by_block:
                level, keys = k, self._by_block[hashes[k]]
                break
        ranked = []
        for key in keys:
            e = self.entries[key]
            score = level * self.block
            for n, h in e.ends:  # an exact turn boundary inside the next block beats the block
                if score < n <= len(prompt) and n // self.block == level \
                        and h == end_hash(hashes, prompt, self.block, n):
                    score = n
            if score:
                ranked.append((score, e.seq, key))
        return sorted(ranked, reverse=True)

    def superseded(self, ns: str, tokens: np.ndarray, hashes: list[str]) -> list[Entry]:
        """Entries of NS whose tokens are a prefix of TOKENS (a longer entry replaces them)."""
        n = len(tokens)
        return [e for e in self.entries.values() if e.ns == ns and e.length <= n
                and e.ends[-1][1] == end_hash(hashes, tokens, self.block, e.length)]

    def eviction_order(self, servable: set[str]) -> list[Entry]:
        """Entries on disk, first to go first: outside the window, then least recently used."""
        return sorted((e for e in self.entries.values() if e.key not in self._memory_only),
                      key=lambda e: (e.ns in servable, e.seq))

    def older_than(self, base: str, version: int) -> list[Entry]:
        return [e for e in self.entries.values() if e.base == base and e.version < version]

    def forget_missing(self, on_disk: set[str]) -> None:
        for key in [k for k in self.entries if k not in on_disk and k not in self._memory_only]:
            self.drop(key)

    def versions(self, base: str) -> dict[str, int]:
        entries = list(self.entries.values())  # one C call: safe beside the writer thread
        counts = Counter(e.version for e in entries if e.base == base)
        return {str(v): n for v, n in sorted(counts.items())}
