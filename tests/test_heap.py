"""frozen_heap: the heap alive before a run is out of the collector's walks during it, and
collectable again after it (nothing leaks)."""

import gc
import weakref

from steerable.heap import frozen_heap


class _Node:
    pass


def _cycle() -> weakref.ref:
    node = _Node()
    node.self = node  # only the collector frees a cycle
    return weakref.ref(node)


def test_a_cycle_dropped_during_the_run_is_collected_after_it():
    gc.collect()
    before = gc.get_freeze_count()
    node = _Node()
    node.self = node
    alive = weakref.ref(node)
    with frozen_heap():
        assert gc.get_freeze_count() > before
        del node
        gc.collect()
        assert alive() is not None  # frozen: no collection walks it
    assert gc.get_freeze_count() == before
    gc.collect()
    assert alive() is None


def test_nested_runs_share_one_freeze_undone_by_the_last():
    before = gc.get_freeze_count()
    with frozen_heap():
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > before  # the inner run's end did not unfreeze
    assert gc.get_freeze_count() == before


def test_garbage_made_during_the_run_is_collected_during_it():
    with frozen_heap():
        alive = _cycle()
        gc.collect()
        assert alive() is None


def test_an_error_inside_the_run_still_unfreezes():
    before = gc.get_freeze_count()
    try:
        with frozen_heap():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == before


def test_a_heap_the_application_froze_stays_frozen_after_a_run():
    """No second freeze (an object made after the application's is still walked) and no unfreeze.
    Frozen objects freed meanwhile lower the freeze count, so the checks do not compare counts."""
    gc.freeze()
    try:
        made_after = _Node()
        with frozen_heap():
            assert any(o is made_after for o in gc.get_objects())  # the permanent generation is not listed
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_back_to_back_runs_do_not_keep_the_garbage_of_the_ones_before():
    """Each run's cycles die with it; the next run starts right after, with no full collection
    between them: they must not be frozen into it (a loop of runs would keep them all)."""
    alive = []
    for _ in range(3):
        with frozen_heap():
            assert all(ref() is None for ref in alive)
            alive.append(_cycle())
    gc.collect()
    assert all(ref() is None for ref in alive)
