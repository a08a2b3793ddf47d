"""Reward functions on tricky inputs, and scoring that survives a raising reward."""

import pytest

from dorarl.tasks import Prompt, RunningSumTask, score
from dorarl.tasks.rewards import exact_match, get_reward, math_equivalent


@pytest.mark.parametrize(
    "response, answer",
    [
        ("0.5", "1/2"),
        ("\\frac{1}{2}", "0.5"),
        ("The answer is $\\frac{1}{2}$.", "1/2"),
        ("\\boxed{\\frac12}", "0.5"),
        ("x = 2", "2"),
        ("$2\\sqrt{2}$", "\\sqrt{8}"),
        ("\\boxed{3}", "3"),
    ],
)
def test_math_reward_accepts_equivalent_forms(response, answer):
    assert math_equivalent(response, answer) == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [("0.25", "1/2"), ("", "1/2"), ("no idea", "3"), ("\\frac{1}{", "0.5"), ("$$$", "2")],
)
def test_math_reward_rejects_wrong_or_malformed_answers(response, answer):
    assert math_equivalent(response, answer) == 0.0


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("91 + 67 = ?", 0.0),  # the question restated: math-verify alone read it as 158
        ("What is 91 + 67?", 0.0),
        ("The answer is 91 + 67.", 0.0),
        ("\\boxed{91 + 67}", 0.0),
        ("$91 + 67$", 0.0),
        ("The answer is 158.", 1.0),
        ("\\boxed{158}", 1.0),
        ("91 + 67 = 158", 1.0),
        ("158 = 91 + 67", 1.0),
        ("91 + 67 = 158. Let me know if you need anything else!", 1.0),
        ("Adding 91 and 67 gives 150, plus 8 more: 158", 1.0),
        ("The answer is 158, not 157.", 1.0),
        ("The answer is 157, not 158.", 0.0),
        ("\\boxed{157} (though 158 = 91 + 67)", 0.0),
        ("91 + 67 = 158 = 157", 0.0),
        ("The answer is 1,58.", 0.0),
    ],
)
def test_math_reward_scores_the_final_answer_only(response, reward):
    assert math_equivalent(response, "158") == reward


@pytest.mark.parametrize(
    "response",  # the extraction's own cases are in test_answers.py; these reach the reward
    [
        "The answer is 6 or maybe 5",
        "\\boxed{6 \\text{ or } 5}",
        "So the answer is 5, or else 6.",
        "\\boxed{6}, \\boxed{5}",
        "The answer is 6 \\vee 5",
    ],
)
@pytest.mark.parametrize("answer", ["5", "6"])
def test_math_reward_gives_a_hedge_nothing_whichever_value_is_right(response, answer):
    assert math_equivalent(response, answer) == 0.0


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("The answer is 1,234", "1234"),
        ("5.", "5"),
        ("-3", "-3"),
        ("\\boxed{12}", "12"),
        ("x = 5", "5"),
        ("The answer is 2.5 meters.", "2.5"),
        ("The answer is 5, 6", "5, 6"),  # a list answer still meets a list reference
    ],
)
def test_math_reward_still_scores_single_answers(response, answer):
    assert math_equivalent(response, answer) == 1.0


def test_math_reward_raises_on_an_unparseable_reference():
    with pytest.raises(ValueError, match="reference answer"):
        math_equivalent("1", "@@@")
    with pytest.raises(ValueError, match="reference answer"):  # whatever the response
        math_equivalent("91 + 67 = ?", "@@@")


def test_exact_match_strips_whitespace_only():
    assert exact_match(" 42\n", "42") == 1.0
    assert exact_match("42.0", "42") == 0.0
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward("fuzzy")


class _RaisingTask(RunningSumTask):
    def reward(self, prompt, response_ids):
        raise ZeroDivisionError("boom")


class _NanTask(RunningSumTask):
    def reward(self, prompt, response_ids):
        return float("nan")


def test_score_turns_a_raising_or_non_finite_reward_into_zero_and_an_error():
    prompt = Prompt(0, "a1=", [1, 69, 21, 33], "a1")
    reward, error = score(_RaisingTask(), prompt, [69, 21, 2])
    assert (reward, error) == (0.0, "ZeroDivisionError: boom")
    reward, error = score(_NanTask(), prompt, [69, 21, 2])
    assert reward == 0.0 and "not finite" in error


def test_math_off_the_main_thread_says_nothing_of_its_disabled_timeout(monkeypatch, caplog):
    """Rewards of agents and environments run in threads, where math-verify's timeout is off;
    its one-time warning about that is dropped, not shown in the run's terminal."""
    import threading

    import math_verify.grader
    import math_verify.parser

    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False, raising=False)
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False, raising=False)
    results = []
    worker = threading.Thread(target=lambda: results.append(math_equivalent("x = \\frac{1}{2}", "0.5")))  # fmt: skip
    worker.start()
    worker.join(timeout=60)
    assert results == [1.0] and "Timeout is disabled" not in caplog.text
