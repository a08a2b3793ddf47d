"""Progress: staleness as a short histogram, an ETA, plain lines when not on a terminal, the
newest evaluation (with mean@k and pass@k when it sampled), the episodes an environment
failed."""

import io

from rich.console import Console

from dorarl.jobs.progress import TrainProgress, plain_every, staleness_histogram


def _row(version, staleness=None):
    return {"new_version": version, "reward_mean": 0.25, "tokens_per_s": 100.0,
            "step_time_s": 1.0, "staleness": staleness or {"0": 12, "1": 4}}  # fmt: skip


def test_staleness_is_a_histogram_not_a_dict():
    assert staleness_histogram({"0": 12, "1": 4}) == "█▃ 0:12 1:4"
    assert staleness_histogram({"0": 3, "2": 3}) == "█ █ 0:3 2:3"  # no group at staleness 1
    assert staleness_histogram({}) == "-"


def test_off_a_terminal_one_plain_line_every_few_steps_with_an_eta():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with TrainProgress(40, console=console) as progress:
        assert not progress.live
        for v in range(1, 41):
            progress.update(_row(v), {1: {"version": 1, "accuracy": 0.5}})
    lines = [line for line in out.getvalue().splitlines() if line.startswith("train step")]
    assert plain_every(40) == 2 and len(lines) == 20
    assert lines[0].startswith("train step 2/40 (v2)") and "eta " in lines[0]
    assert "stale █▃ 0:12 1:4" in lines[0] and "{" not in lines[0]
    assert lines[-1].startswith("train step 40/40") and "eta 0m00s" in lines[-1]
    assert lines[0].endswith("eval v1: 0.500")


def test_a_sampled_evaluation_shows_mean_and_pass_at_k():
    out = io.StringIO()
    sampled = {"version": 2, "accuracy": 0.5, "mean@4": 0.375, "pass@2": 0.5, "pass@4": 0.75}
    with TrainProgress(1, console=Console(file=out, width=200)) as progress:
        progress.update(_row(2), {0: {"version": 0, "accuracy": 0.1}, 2: sampled})
    (line,) = out.getvalue().splitlines()
    assert line.endswith("eval v2: 0.500 mean@4 0.375 pass@4 0.750")


def test_an_evaluation_shows_how_many_held_out_prompts_it_scored():
    out = io.StringIO()
    with TrainProgress(1, console=Console(file=out, width=200)) as progress:
        progress.update(_row(1), {1: {"version": 1, "accuracy": 1 / 3, "n": 3.0}})
    assert out.getvalue().splitlines()[0].endswith("eval v1 (n=3): 0.333")


def test_episodes_an_environment_failed_are_counted_in_the_line():
    out = io.StringIO()
    with TrainProgress(2, console=Console(file=out, width=200)) as progress:
        progress.update(_row(1) | {"env_errors": 0}, {})
        progress.update(_row(2) | {"env_errors": 7}, {})
    first, second = out.getvalue().splitlines()
    assert "env errors" not in first and "  env errors 7" in second


def test_progress_false_prints_nothing():
    out = io.StringIO()
    with TrainProgress(4, enabled=False, console=Console(file=out)) as progress:
        progress.update(_row(1), {})
        progress.note("final evaluation")
    assert out.getvalue() == ""


def test_warnings_go_through_the_console_the_bar_draws_on(monkeypatch):
    import logging

    from rich.logging import RichHandler

    from dorarl.jobs.train import _setup_logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    try:
        _setup_logging()
        (handler,) = root.handlers
        # rich prints records through the live display's console above the bar, not into it
        assert isinstance(handler, RichHandler)
        assert handler.console is TrainProgress(1).console
    finally:
        logging.captureWarnings(False)
