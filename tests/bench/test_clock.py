"""The benches' clocks: wall and CPU time apart, laps, another process's CPU clock kept out
of the wall time, and the load average either side of a run."""

import time

import pytest

from dorarl.bench import clock


def _spin(cpu_seconds: float) -> int:
    """Busy on one thread until this process has spent `cpu_seconds` more."""
    end, n = time.process_time() + cpu_seconds, 0
    while time.process_time() < end:
        n += 1
    return n


def test_sleeping_takes_wall_time_but_no_cpu_and_spinning_takes_both():
    result, slept = clock.timed(lambda: time.sleep(0.2) or "done")
    assert result == "done"
    assert slept.wall_s >= 0.2 and slept.cpu_s < 0.1
    _, spun = clock.timed(lambda: _spin(0.1))
    assert spun.cpu_s >= 0.1 and spun.wall_s >= 0.9 * spun.cpu_s  # one thread busy


def test_a_slow_cpu_clock_adds_nothing_to_the_wall_time():
    """The actors' CPU clock is a round trip: read outside the wall interval."""
    reads = []

    def actors_cpu_s() -> float:
        time.sleep(0.2)
        reads.append(len(reads))
        return 10.0 * len(reads)

    _, took = clock.timed(lambda: None, cpu_clock=actors_cpu_s)
    assert reads == [0, 1]
    assert took.cpu_s == 10.0
    assert took.wall_s < 0.1


def test_laps_keep_every_timing_in_order_with_medians_and_totals():
    laps = clock.Laps()
    for took in (clock.Took(3.0, 1.0), clock.Took(1.0, 2.0), clock.Took(2.0, 6.0)):
        laps.add(took)
    assert len(laps) == 3 and laps.wall_s == [3.0, 1.0, 2.0]
    assert laps.median() == clock.Took(2.0, 2.0)
    assert laps.total() == clock.Took(6.0, 9.0)
    assert laps.time(lambda: 7) == 7 and len(laps) == 4


def test_the_load_window_reads_the_load_before_and_after():
    with clock.load_window() as window:
        assert len(window.start) == 3 and window.end == []
    assert len(window.end) == 3
    assert all(x >= 0 and x == round(x, 2) for x in window.start + window.end)
    assert window.fields() == {"load_average_start": window.start, "load_average": window.end}


def test_the_load_window_closes_when_the_run_fails():
    with pytest.raises(RuntimeError), clock.load_window() as window:
        raise RuntimeError("the bench failed")
    assert len(window.end) == 3
