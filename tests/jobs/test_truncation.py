"""Responses cut by a length limit: a step whose cut share passes sampling.warn_truncated
warns in one line naming the key to raise (the context's or the response cap's, told apart
by how many tokens the cut turn sampled), once, then again only when it gets worse."""

import io
import logging

from rich.console import Console

from dorarl.data import Group, Sample, Turn
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.progress import TrainProgress
from dorarl.jobs.ray_run import truncation_watch
from dorarl.jobs.truncation import CAP_KEY, CONTEXT_KEY, TruncationWatch, count_cuts, cut_by


def _sample(tokens: int, reason: str, turns: list[Turn] | None = None) -> Sample:
    return Sample(0, 0, 0, [1] * 4, [2] * tokens, finish_reason=reason, turns=turns or [])


def _step(cut: int, of: int = 10, tokens: int = 8) -> list[Group]:
    """`of` responses, `cut` of them cut after `tokens` tokens, the rest ended by a stop."""
    samples = [_sample(tokens, "length") for _ in range(cut)]
    samples += [_sample(5, "stop") for _ in range(of - cut)]
    return [Group(0, 0, 0, samples)]


def test_a_cut_short_of_the_cap_is_the_contexts_and_one_at_the_cap_is_the_caps():
    assert cut_by(_sample(8, "length"), max_new_tokens=128) == CONTEXT_KEY
    assert cut_by(_sample(128, "length"), max_new_tokens=128) == CAP_KEY
    assert cut_by(_sample(8, "stop"), max_new_tokens=128) is None
    turns = [Turn(128, 3, "stop"), Turn(8, 0, "length")]  # the last turn ran into the context
    assert cut_by(_sample(139, "length", turns), max_new_tokens=128) == CONTEXT_KEY
    cuts = count_cuts(_step(8) + [Group(1, 1, 0, [_sample(128, "length")])], 128)
    assert (cuts.responses, cuts.by_context, cuts.by_cap) == (11, 8, 1)


def test_a_context_too_small_warns_at_the_first_step_naming_engine_max_model_len(caplog):
    watch = TruncationWatch(max_model_len=256, max_new_tokens=128)
    with caplog.at_level(logging.WARNING):
        warning, flag = watch.observe(0, _step(8))
    assert warning is not None and "\n" not in warning
    assert "80%" in warning and "engine.max_model_len" in warning and "256" in warning
    assert "sampling.max_new_tokens" not in warning
    assert "engine.max_model_len" in flag and "80%" in flag
    assert warning in caplog.text


def test_a_cap_too_small_names_sampling_max_new_tokens():
    warning, flag = TruncationWatch(256, 16).observe(3, _step(5, tokens=16))
    assert "sampling.max_new_tokens" in warning and "engine.max_model_len" not in warning
    assert "step 3" in warning and "sampling.max_new_tokens" in flag


def test_it_warns_once_then_only_when_the_share_gets_worse():
    watch = TruncationWatch(256, 128, threshold=0.2)
    shares = [1, 3, 3, 2, 3, 4, 4, 9, 9, 1]  # of 10
    seen = [watch.observe(step, _step(cut)) for step, cut in enumerate(shares)]
    assert [step for step, (warning, _) in enumerate(seen) if warning] == [1, 5, 7]
    # the progress line flags every step over the threshold, warned or not
    assert [bool(flag) for _, flag in seen] == [cut > 2 for cut in shares]


def test_under_the_threshold_or_with_forced_lengths_nothing_warns():
    assert TruncationWatch(256, 128).observe(0, _step(2)) == (None, "")
    forced = TrainConfig()
    forced.forced_lengths.enabled = True
    assert truncation_watch(forced, 128).observe(0, _step(10)) == (None, "")
    assert truncation_watch(TrainConfig(), 128).threshold == 0.2


def test_the_progress_line_carries_the_flag():
    out = io.StringIO()
    progress = TrainProgress(1, console=Console(file=out, force_terminal=False, width=300))
    row = {"reward_mean": 0.0, "tokens_per_s": 1.0, "step_time_s": 1.0, "staleness": {},
           "new_version": 1}  # fmt: skip
    progress.update(row, {}, flag="cut 80% (raise engine.max_model_len)")
    assert "cut 80% (raise engine.max_model_len)" in out.getvalue()
