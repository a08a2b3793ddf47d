"""The code task: problems with tests, a response's program run in the sandbox on each, the
reward the share passed (or all-or-nothing) with the first failure recorded."""

from __future__ import annotations

import json

import pytest
from scripts_dir import load_script

from dorarl.errors import UserInputError
from dorarl.tasks import make_task
from dorarl.tasks.assets import CODE_PROBLEMS
from dorarl.tasks.chartok import build_char_tokenizer
from dorarl.tasks.code import DEMONSTRATION
from dorarl.tasks.code_blocks import final_code_block
from dorarl.tasks.code_reward import NO_CODE, PART
from dorarl.tasks.data_files import read_rows
from dorarl.tasks.sandbox import SandboxFailure, bwrap_problem
from dorarl.tasks.scoring import score_all

SANDBOX = "bwrap" if bwrap_problem() is None else "unsafe_rlimits_only"
DOUBLE = {
    "prompt": "Read an integer and print it doubled.",
    "language": "python",
    "tests": [{"stdin": "2\n", "stdout": "4\n"}, {"stdin": "5\n", "stdout": "10\n"}],
}
SQUARE = {
    "prompt": "Write square(n).",
    "tests": [{"assert": "assert square(3) == 9"}, {"assert": "assert square(-2) == 4"}],
}


def _task(tmp_path, rows=(DOUBLE, SQUARE), **kw):
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = {"tokenizer": build_char_tokenizer(), "max_model_len": 2048, "max_new_tokens": 256,
          "eval_fraction": 0.0, "sandbox": SANDBOX, "test_timeout_s": 20.0, "shuffle": False,
          **kw}  # fmt: skip
    return make_task("code", path=path, **kw)


def _scored(task, answers):
    """Each (prompt index, response text)'s Scored."""
    prompts = task.train_prompts()
    return score_all(task, [(prompts[i], _ids(task, text)) for i, text in answers])


def _ids(task, text):
    return list(task.tokenizer(text, add_special_tokens=False)["input_ids"])


def _block(code):
    return f"Here it is:\n```python\n{code}\n```\n"


def test_right_half_right_and_wrong_programs_score_the_share_of_tests_passed(tmp_path):
    task = _task(tmp_path)
    right, half, crash = _scored(
        task,
        [
            (0, _block("print(int(input()) * 2)")),
            (0, _block("n = int(input())\nprint(4 if n == 2 else 0)")),
            (1, _block("def square(n):\n    raise ValueError('no')")),
        ],
    )
    assert (right.reward, right.error, right.parts, right.info) == (1.0, None, {PART: 1.0}, {})
    assert half.reward == 0.5 and half.error is None and half.parts == {PART: 0.5}
    assert half.info == {"first_failure": "test 2 of 2: wrong output: expected '10\\n', got '0\\n'"}
    assert crash.reward == 0.0 and crash.error is None
    assert crash.info["first_failure"] == "test 1 of 2: ValueError: no"


def test_assert_tests_run_after_the_function(tmp_path):
    good, wrong = _scored(
        _task(tmp_path),
        [
            (1, _block("def square(n):\n    return n * n")),
            (1, _block("def square(n):\n    return n")),
        ],
    )
    assert good.reward == 1.0 and wrong.reward == 0.0
    assert wrong.info == {"first_failure": "test 1 of 2: AssertionError: 'assert square(3) == 9'"}


def test_all_tests_gives_one_only_when_every_test_passes(tmp_path):
    task = _task(tmp_path, reward="all_tests")
    half, right = _scored(
        task,
        [
            (0, _block("n = int(input())\nprint(4 if n == 2 else 0)")),
            (0, _block("print(2 * int(input()))")),
        ],
    )
    assert (half.reward, half.parts) == (0.0, {PART: 0.5}) and right.reward == 1.0


def test_a_response_without_a_closed_python_block_scores_zero_and_says_so(tmp_path):
    (scored,) = _scored(_task(tmp_path), [(0, "print(int(input()) * 2)")])
    assert (scored.reward, scored.error, scored.info) == (0.0, None, {"first_failure": NO_CODE})


def test_a_harmful_or_hanging_program_scores_zero_with_its_cause_and_the_run_goes_on(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"token": "secret"}')
    (reads,) = _scored(_task(tmp_path), [(0, _block(f"print(open({str(config)!r}).read())"))])
    (sleeps,) = _scored(
        _task(tmp_path, test_timeout_s=1.0), [(0, _block("import time\ntime.sleep(10**6)"))]
    )
    if SANDBOX == "bwrap":  # the weak sandbox can read what its user can
        assert reads.reward == 0.0 and "FileNotFoundError" in reads.info["first_failure"]
    assert sleeps.reward == 0.0 and sleeps.error is None
    assert sleeps.info["first_failure"] == "test 1 of 2: timed out after 1.0 s"


def test_a_sandbox_failure_is_a_reward_error_not_a_dead_run(tmp_path, monkeypatch, caplog):
    task = _task(tmp_path)

    def broken(source, stdin=""):
        raise SandboxFailure("bwrap: Creating new namespace failed")

    monkeypatch.setattr(task.user_rewards.sandbox, "run", broken)
    first, second = _scored(task, [(0, _block("print(1)")), (0, _block("print(2)"))])
    assert first.reward == 0.0 and first.error.startswith("SandboxFailure: bwrap: Creating")
    assert second.error == first.error
    assert sum("code sandbox failed" in r.message for r in caplog.records) == 1


def test_bad_rows_are_refused_naming_their_line(tmp_path):
    bad = {"prompt": "x", "language": "rust", "tests": [{"stdin": "", "stdout": ""}]}
    with pytest.raises(UserInputError, match=r"code.jsonl:2: language 'rust'"):
        _task(tmp_path, rows=(DOUBLE, bad))
    with pytest.raises(UserInputError, match=r"code.jsonl:1 test 0: expected \{stdin, stdout\}"):
        _task(tmp_path, rows=({"prompt": "x", "tests": [{"stdout": 3}]},))
    with pytest.raises(UserInputError, match="task.reward: the code task scores by its tests"):
        _task(tmp_path, reward="math")


def test_the_shipped_problems_load_and_each_has_tests():
    rows = [row for _, row in read_rows(CODE_PROBLEMS)]
    assert len(rows) >= 150 and len({r["prompt"] for r in rows}) == len(rows)
    task = make_task("code", tokenizer=build_char_tokenizer(), max_model_len=2048,
                     max_new_tokens=256, sandbox=SANDBOX, shuffle=False)  # fmt: skip
    assert len(task.train_prompts()) + len(task.eval_prompts()) == len(rows)
    first = task.train_prompts()[0]
    assert first.row["tests"] and first.text.endswith("```python code block.")


def test_with_the_chat_template_one_solved_problem_comes_before_the_prompt(
    tmp_path, chat_tokenizer
):
    task = _task(tmp_path, tokenizer=chat_tokenizer, chat_template=True)
    text = chat_tokenizer.decode(task.train_prompts()[0].prompt_ids)
    shown = text.split("<|im_start|>assistant\n")
    assert len(shown) == 3 and shown[2] == ""
    solved = shown[1].split("<|im_end|>")[0]
    assert solved.startswith("```python\n") and solved.endswith("\n```")
    assert text.endswith(f"<|im_start|>user\n{DOUBLE['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    bare = _task(tmp_path, tokenizer=chat_tokenizer, chat_template=True, demonstration=False)
    assert chat_tokenizer.decode(bare.train_prompts()[0].prompt_ids).count("assistant\n") == 1


def test_the_demonstration_is_solved_and_no_shipped_problem(tmp_path):
    user, assistant = DEMONSTRATION
    program = final_code_block(assistant["content"])
    tests = [("the quick brown fox\n", "2\n"), ("a an apple\n", "1\n"), ("\n", "0\n")]
    solved = _task(tmp_path, rows=({"prompt": user["content"], "tests": [
        {"stdin": i, "stdout": o} for i, o in tests]},))  # fmt: skip
    assert _scored(solved, [(0, _block(program))])[0].reward == 1.0
    assert user["content"] not in {row["prompt"] for _, row in read_rows(CODE_PROBLEMS)}


def test_the_shipped_problems_are_the_scripts_and_mix_their_families_from_the_first_rows():
    rows = [row for _, row in read_rows(CODE_PROBLEMS)]
    written = load_script("make_code_problems").problems(0)
    assert [{k: v for k, v in r.items() if k != "id"} for r in rows] == written
    # a run takes its training problems in file order: its first steps see both kinds
    first = {r["prompt"][: len("Write a Python program")] for r in rows[:12]}
    assert first == {"Write a Python program", "Write a Python functio"}
