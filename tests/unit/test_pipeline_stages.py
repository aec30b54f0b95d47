"""run_stages: every item through every stage in order, the stages at once."""

import threading

import pytest

from mpistrat.algorithms.hierarchical import run_stages


def test_each_stage_sees_every_item_in_order_after_the_stage_before():
    log: list[tuple[int, int]] = []
    lock = threading.Lock()

    def stage(index):
        def run(item):
            with lock:
                log.append((index, item))
        return run

    run_stages([stage(0), stage(1), stage(2)], list(range(20)))
    for index in range(3):
        assert [item for s, item in log if s == index] == list(range(20))
    position = {entry: n for n, entry in enumerate(log)}
    assert all(position[(s - 1, item)] < position[(s, item)]
               for s in (1, 2) for item in range(20))


def test_later_stages_run_while_the_first_is_still_working():
    second_started = threading.Event()

    def first(item):
        if item == 1:  # the second stage must take item 0 while this one waits here
            assert second_started.wait(10), "stage 2 did not start on item 0"

    run_stages([first, lambda item: second_started.set()], [0, 1, 2])


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_the_first_error_of_any_stage_is_raised_after_every_stage_stopped(failing):
    seen: list[int] = []

    def stage(index):
        def run(item):
            if index == failing and item == 3:
                raise ValueError(f"stage {index} item {item}")
            if index == 2:
                seen.append(item)
        return run

    with pytest.raises(ValueError, match=f"stage {failing} item 3"):
        run_stages([stage(0), stage(1), stage(2)], list(range(8)))
    assert seen == [0, 1, 2] + ([] if failing < 2 else [])
    assert not [t for t in threading.enumerate() if t.name.startswith("mpistrat-pipeline")]


def test_one_stage_or_one_item_runs_in_the_calling_thread():
    threads = set()
    run_stages([lambda item: threads.add(threading.current_thread())], [1, 2])
    run_stages([lambda i: threads.add(threading.current_thread())] * 2, [1])
    assert threads == {threading.current_thread()}
