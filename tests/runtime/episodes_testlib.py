"""Polling a runtime's `Episodes` as the Ray runtime does, for the episode tests."""

import time


def answers(episodes, n, within_s):
    """The next `n` answers (ready or overdue) by request, polled as the runtime does."""
    got = {}
    deadline = time.monotonic() + within_s
    while len(got) < n and time.monotonic() < deadline:
        got.update(episodes.ready() + episodes.overdue())
        time.sleep(0.01)
    assert len(got) == n, f"{n - len(got)} env call(s) unanswered in {within_s:g} s"
    return got
