"""``quick_handoff``: a short GIL switch interval while a long run drives a GPU, restored after."""

import sys
import threading

import pytest

from steerable import long_runs


@pytest.fixture(autouse=True)
def default_interval():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(previous)


def test_cuda_runs_hand_over_quickly_and_restore_the_interval():
    with long_runs.quick_handoff("cuda"):
        assert sys.getswitchinterval() == pytest.approx(long_runs.RUN_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_cpu_runs_leave_the_interval_alone():
    with long_runs.quick_handoff("cpu"):
        assert sys.getswitchinterval() == pytest.approx(0.005)


def test_nested_and_concurrent_runs_share_one_setting():
    entered, leave = threading.Event(), threading.Event()

    def other_run():
        with long_runs.quick_handoff("cuda"):
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other_run)
    with long_runs.quick_handoff("cuda"):
        with long_runs.quick_handoff("cuda"):
            thread.start()
            assert entered.wait(10)
        assert sys.getswitchinterval() == pytest.approx(long_runs.RUN_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == pytest.approx(long_runs.RUN_SWITCH_INTERVAL_S)  # the other run still holds it
    leave.set()
    thread.join(10)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_error_inside_still_restores():
    with pytest.raises(RuntimeError), long_runs.quick_handoff("cuda"):
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == pytest.approx(0.005)


# Which runs take it: tests/test_heap.py's wiring test (with the heap's freeze).
