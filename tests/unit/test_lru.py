"""The thread-safe LRU cache: bounded by entries and, given a weight, by total weight."""

from __future__ import annotations

from service.lru import LockedLRU


def test_least_recently_used_entries_leave_first() -> None:
    lru: LockedLRU[str, int] = LockedLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get_or_make("a", lambda: 0) == 1  # a hit: "a" is now the newest
    lru.put("c", 3)
    assert "a" in lru and "b" not in lru and "c" in lru
    assert (lru.hits, lru.misses) == (1, 0)


def test_a_budget_bounds_the_total_weight() -> None:
    lru: LockedLRU[str, bytes] = LockedLRU(100, budget=10, weigh=len)
    for key in "abcd":
        lru.put(key, b"xxxx")
    assert list(lru._data) == ["c", "d"] and lru.weight == 8
    lru.put("d", b"x")  # replacing an entry replaces its weight
    assert lru.weight == 5
    lru.put("big", b"y" * 50)  # heavier than the budget alone: kept, everything older leaves
    assert list(lru._data) == ["big"] and lru.weight == 50
    lru.drop(lambda key: key != "big")
    assert len(lru) == 0 and lru.weight == 0


def test_get_or_make_keeps_the_first_value_and_counts_misses() -> None:
    lru: LockedLRU[str, bytes] = LockedLRU(4, budget=100, weigh=len)
    assert lru.get_or_make("k", lambda: b"first") == b"first"
    lru.put("j", b"abc")
    lru.clear()
    assert lru.weight == 0 and len(lru) == 0
    assert lru.get_or_make("k", lambda: b"again") == b"again"
    assert lru.misses == 2


def test_a_value_that_grew_is_weighed_again_when_put_again() -> None:
    """An entry keeps the weight it was stored with: a value that grows in place (a store's
    index in memory) is put again to count its new weight, and leaving takes off what it
    counted, so the total never drifts."""
    lru: LockedLRU[str, bytearray] = LockedLRU(4, budget=10, weigh=len)
    grown = bytearray(b"xx")
    lru.put("old", bytearray(b"xxxx"))
    lru.put("grown", grown)
    assert lru.find("old") is not None  # now the newest: "grown" leaves first
    grown.extend(b"xxxxxx")
    assert lru.weight == 6  # as stored
    lru.put("grown", grown)  # 4 + 8 past the budget: "old" is older now, and leaves
    assert list(lru._data) == ["grown"] and lru.weight == 8
    lru.drop(lambda key: False)
    assert lru.weight == 0 and lru.find("grown") is None
