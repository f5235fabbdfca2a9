"""ExpertSlotTable: victims only among unpinned, landed residents; a full table says so instead of waiting."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_serve.engine.experts.policies import LRUPolicy
from moe_serve.engine.experts.expert_slots import ExpertSlotTable


def _resident(table: ExpertSlotTable, *keys: tuple[int, int]) -> None:
    """Place keys and mark their copies landed, unpinned."""
    placement = table.place(list(keys), pin=False, prefetched=False)
    for key, _ in placement.placed:
        table.complete(key)


def test_free_expert_slots_first_then_lru_victims() -> None:
    table = ExpertSlotTable(2, LRUPolicy())
    _resident(table, (0, 0), (0, 1))
    assert sorted(table.expert_slot_of(k) for k in ((0, 0), (0, 1))) == [0, 1]
    placement = table.place([(1, 5)], pin=False, prefetched=False)
    assert [e.key for e in placement.evictions] == [(0, 0)]
    assert placement.placed == [((1, 5), placement.evictions[0].expert_slot)]
    assert (0, 0) not in table and len(table) == 2


def test_never_evicts_pinned_or_in_flight() -> None:
    table = ExpertSlotTable(3, LRUPolicy())
    _resident(table, (0, 0), (0, 1))
    table.place([(0, 2)], pin=False, prefetched=True)  # in flight: copy not landed
    table.pin((0, 0))
    placement = table.place([(1, 0), (1, 1)], pin=True, prefetched=False)
    assert [e.key for e in placement.evictions] == [(0, 1)]
    assert [k for k, _ in placement.placed] == [(1, 0)]
    assert placement.unplaced == [(1, 1)]
    assert (0, 0) in table and (0, 2) in table


def test_can_hold_counts_free_and_evictable_expert_slots_but_not_the_wave_itself() -> None:
    table = ExpertSlotTable(3, LRUPolicy())
    _resident(table, (0, 1), (0, 2))
    assert table.can_hold([(0, 1), (0, 5), (0, 6)])  # one free expert slot + (0, 2) evictable
    table.place([(1, 0)], pin=False, prefetched=True)  # the free expert slot, still in flight
    assert not table.can_hold([(0, 1), (0, 5), (0, 6)])  # (0, 1) is wanted, (1, 0) is being filled
    assert table.can_hold([(0, 1), (0, 5)])
    table.complete((1, 0))
    assert table.can_hold([(0, 1), (0, 5), (0, 6)])


def test_full_of_pinned_places_nothing() -> None:
    table = ExpertSlotTable(2, LRUPolicy())
    table.place([(0, 0), (0, 1)], pin=True, prefetched=False)
    placement = table.place([(0, 2)], pin=True, prefetched=False)
    assert placement.placed == [] and placement.evictions == [] and placement.unplaced == [(0, 2)]
    table.unpin((0, 0))
    table.complete((0, 0))
    assert [k for k, _ in table.place([(0, 2)], pin=True, prefetched=False).placed] == [(0, 2)]


def test_plan_wave_pins_hits_and_counts_first_use_of_prefetch() -> None:
    table = ExpertSlotTable(3, LRUPolicy())
    _resident(table, (0, 0))
    table.place([(0, 1)], pin=False, prefetched=True)  # prefetched, still in flight
    plan = table.plan_wave([(0, 0), (0, 1), (0, 2)])
    assert plan.hits == [(0, 0), (0, 1)] and plan.hits_in_flight == [(0, 1)]
    assert plan.prefetch_used == 1
    assert [k for k, _ in plan.misses.placed] == [(0, 2)]
    assert all(table.is_pinned(k) for k in ((0, 0), (0, 1), (0, 2)))
    assert table.plan_wave([]).prefetch_used == 0


def test_evicting_an_unused_prefetch_is_counted_as_wasted() -> None:
    table = ExpertSlotTable(1, LRUPolicy())
    table.place([(0, 0)], pin=False, prefetched=True)
    table.complete((0, 0))
    placement = table.place([(0, 1)], pin=False, prefetched=False)
    assert [(e.key, e.wasted_prefetch) for e in placement.evictions] == [((0, 0), True)]


def test_misuse_raises() -> None:
    table = ExpertSlotTable(2, LRUPolicy())
    _resident(table, (0, 0))
    with pytest.raises(ValueError, match="already resident"):
        table.place([(0, 0)], pin=False, prefetched=False)
    with pytest.raises(KeyError):
        table.unpin((0, 0))
    with pytest.raises(ValueError):
        ExpertSlotTable(0, LRUPolicy())


def test_drop_frees_the_expert_slot_without_an_eviction() -> None:
    table = ExpertSlotTable(1, LRUPolicy())
    table.place([(0, 0)], pin=True, prefetched=False)
    table.drop((0, 0))
    assert len(table) == 0 and not table.is_pinned((0, 0))
    assert table.place([(0, 1)], pin=False, prefetched=False).evictions == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["place", "pin", "unpin", "complete", "prefetch", "expect"]),
                          st.integers(0, 5)), max_size=60))
def test_random_operations_keep_the_invariants(ops: list[tuple[str, int]]) -> None:
    """Whatever happens, victims are only unpinned landed residents, LRU evicts the oldest, a
    prefetch passes over open predictions (prefetched or expected while resident, not used since)
    and a demand copy takes them only when nothing else can go."""
    table = ExpertSlotTable(3, LRUPolicy())
    last_use: dict[tuple[int, int], int] = {}
    open_predictions: set[tuple[int, int]] = set()
    for clock, (op, e) in enumerate(ops):
        key = (0, e)
        resident, pinned, flying = key in table, table.is_pinned(key), table.is_in_flight(key)
        if op in ("place", "prefetch") and not resident:
            candidates = _should_be_evictable(table) - open_predictions
            if op == "place" and not candidates:
                candidates = _should_be_evictable(table)
            expected_victim = min(candidates, key=last_use.get, default=None)
            placement = table.place([key], pin=op == "place", prefetched=op == "prefetch")
            for eviction in placement.evictions:
                assert eviction.key == expected_victim
                open_predictions.discard(eviction.key)
            if op == "prefetch" and placement.placed:
                open_predictions.add(key)
            last_use[key] = clock
        elif op == "pin" and resident:
            table.use(key)
            table.pin(key)
            open_predictions.discard(key)
            last_use[key] = clock
        elif op == "unpin" and pinned:
            table.unpin(key)
        elif op == "complete" and flying:
            table.complete(key)
        elif op == "expect":
            table.expect([key])
            if resident:
                open_predictions.add(key)
        assert table.evictable() == _should_be_evictable(table)
        assert len(table) <= table.capacity


def _should_be_evictable(table: ExpertSlotTable) -> set[tuple[int, int]]:
    return {(0, e) for e in range(6)
            if (0, e) in table and not table.is_pinned((0, e)) and not table.is_in_flight((0, e))}


def test_a_prefetch_never_evicts_an_open_prediction() -> None:
    """Prefetched and unused, its layer not yet run: other prefetches leave it, a demand copy
    may take it, and once its layer ran without it any copy may."""
    table = ExpertSlotTable(2, LRUPolicy())
    for key in ((0, 1), (1, 1)):  # predictions for layers 0 and 1, both landed
        table.place([key], pin=False, prefetched=True)
        table.complete(key)
    dropped = table.place([(1, 2)], pin=False, prefetched=True)
    assert dropped.placed == [] and dropped.unplaced == [(1, 2)]
    plan = table.plan_wave([(0, 3)])  # layer 0 runs without (0, 1): that guess was wrong
    assert [e.key for e in plan.misses.evictions] == [(0, 1)] and plan.misses.evictions[0].wasted_prefetch
    table.unpin((0, 3))
    table.complete((0, 3))
    later = table.place([(1, 2)], pin=False, prefetched=True)  # (1, 1) is still open: (0, 3) goes
    assert [e.key for e in later.evictions] == [(0, 3)]


def test_a_demand_copy_takes_an_open_prediction_only_when_nothing_else_can_go() -> None:
    table = ExpertSlotTable(2, LRUPolicy())
    table.place([(1, 1)], pin=False, prefetched=True)  # the oldest resident, but an open prediction
    table.complete((1, 1))
    _resident(table, (0, 2))
    first = table.place([(0, 5)], pin=True, prefetched=False)
    assert [e.key for e in first.evictions] == [(0, 2)]
    table.complete((0, 5))
    second = table.place([(0, 6)], pin=True, prefetched=False)  # (0, 5) is pinned: only the guess is left
    assert [(e.key, e.wasted_prefetch) for e in second.evictions] == [((1, 1), True)]


def test_an_expected_resident_expert_is_kept_like_a_prefetched_one() -> None:
    """Predicted while already resident: a prefetch passes over it, its layer's run ends it."""
    table = ExpertSlotTable(2, LRUPolicy())
    _resident(table, (1, 1), (0, 2))  # (1, 1) is the least recently used
    table.expect([(1, 1), (1, 7)])  # (1, 7) is not resident: nothing to keep
    later = table.place([(0, 4)], pin=False, prefetched=True)
    assert [e.key for e in later.evictions] == [(0, 2)]
    table.complete((0, 4))
    table.plan_wave([(1, 3)])  # layer 1 ran without (1, 1): the prediction is over
    assert (1, 1) not in table


def test_kept_keys_are_never_victims_until_keeping_ends() -> None:
    """A streamed span's kept experts: neither a prefetch nor a demand copy may take their expert slots,
    room counts only the others, and a layer's keep replaces only that layer's kept keys."""
    table = ExpertSlotTable(3, LRUPolicy())
    _resident(table, (0, 0), (1, 0), (0, 1))  # (0, 0) is the least recently used
    table.keep(0, [(0, 0), (0, 1)])
    assert table.kept == 2 and table.room() == 1 and not table.can_hold([(2, 0), (2, 1)])
    placement = table.place([(2, 0), (2, 1)], pin=True, prefetched=False)
    assert [e.key for e in placement.evictions] == [(1, 0)] and placement.unplaced == [(2, 1)]
    table.unpin((2, 0))
    table.complete((2, 0))
    table.keep(1, [(1, 5)])  # not resident: protected once placed, and no other layer's keys change
    assert table.kept == 3 and table.is_kept((0, 0)) and table.is_kept((1, 5))
    table.keep(0, [(0, 1)])  # (0, 0) is no longer kept: the least recently used goes first again
    assert [e.key for e in table.place([(2, 2)], pin=False, prefetched=False).evictions] == [(0, 0)]
    table.complete((2, 2))
    table.keep_nothing()
    assert table.kept == 0 and table.room() == 3
