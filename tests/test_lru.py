"""The one bounded LRU (rlproxy/lru.py) every cache and key set uses: its order, its two
bounds, and the difference between refreshing a key (`put`, `get`) and not (`assign`, `peek`)."""

from rlproxy.lru import LRU


def test_count_bound_evicts_the_least_recently_used():
    lru = LRU(max_items=2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the newest
    lru.put("c", 3)
    assert list(lru) == ["a", "c"] and lru.evicted == 1


def test_peek_and_assign_leave_the_order_alone():
    lru = LRU(max_items=2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.peek("a") == 1
    lru.assign("a", 10)  # as d["a"] = 10 on an OrderedDict: a keeps its place, the oldest
    lru.put("c", 3)
    assert list(lru) == ["b", "c"] and lru.peek("a") is None
    lru.assign("d", 4)  # a new key goes to the newest end
    assert list(lru) == ["c", "d"]


def test_byte_bound_counts_replacements_and_keeps_one_oversized_entry():
    lru = LRU(max_bytes=10)
    lru.put("a", "x", nbytes=4)
    lru.put("b", "y", nbytes=4)
    lru.assign("a", "z", nbytes=7)  # 7 + 4 > 10: the oldest (a) goes
    assert list(lru) == ["b"] and lru.nbytes == 4
    lru.put("big", "w", nbytes=50)  # alone over the budget: kept, everything else goes
    assert list(lru) == ["big"] and lru.nbytes == 50
    assert lru.pop("big") == "w" and lru.nbytes == 0 and len(lru) == 0


def test_trim_to_a_new_count_and_use_as_a_set():
    keys = LRU()
    for k in "abcde":
        keys.add(k)
    keys.discard("c")
    keys.trim(2)
    assert list(keys) == ["d", "e"] and "d" in keys and keys.oldest() == "d"
