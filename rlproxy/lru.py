"""One bounded LRU map: least recently used entries leave first, past a count or a byte budget.

`LRU(max_items, max_bytes)`: `put(key, value, nbytes=0)` inserts or refreshes a key and evicts
from the old end until both bounds hold (an entry alone over the byte budget stays); `assign`
does the same but leaves an existing key where it is (as `d[key] = value` on an OrderedDict);
`get(key)` reads and refreshes; `peek(key)` reads without refreshing. A set is an LRU whose values are None (`add`).
Not thread-safe: the owner holds its own lock where threads share it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Iterator, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    def __init__(self, max_items: int | None = None, max_bytes: int | None = None):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:  # oldest first
        return iter(self._data)

    def items(self):
        return ((k, v) for k, (v, _) in self._data.items())

    def values(self):
        return (v for v, _ in self._data.values())

    def get(self, key: K, default=None):
        if key not in self._data:
            return default
        self._data.move_to_end(key)
        return self._data[key][0]

    def peek(self, key: K, default=None):
        entry = self._data.get(key)
        return default if entry is None else entry[0]

    def put(self, key: K, value: V, nbytes: int = 0) -> None:
        old = self._data.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self._data[key] = (value, nbytes)
        self.nbytes += nbytes
        self.trim()

    def assign(self, key: K, value: V, nbytes: int = 0) -> None:
        old = self._data.get(key)
        if old is None:
            self.put(key, value, nbytes)
            return
        self.nbytes += nbytes - old[1]
        self._data[key] = (value, nbytes)  # an OrderedDict keeps an existing key's place
        self.trim()

    def add(self, key: K) -> None:
        self.put(key, None)

    def pop(self, key: K, default=None):
        entry = self._data.pop(key, None)
        if entry is None:
            return default
        self.nbytes -= entry[1]
        return entry[0]

    def discard(self, key: K) -> None:
        self.pop(key)

    def oldest(self) -> K | None:
        return next(iter(self._data), None)

    def trim(self, max_items: int | None = None) -> None:
        """Evict down to the bounds (MAX_ITEMS, when given, replaces the count bound)."""
        if max_items is not None:
            self.max_items = max_items
        while self._data and (
                (self.max_items is not None and len(self._data) > self.max_items)
                or (self.max_bytes is not None and self.nbytes > self.max_bytes
                    and len(self._data) > 1)):
            _, (_, n) = self._data.popitem(last=False)
            self.nbytes -= n
            self.evicted += 1
