"""Users' rewards: `module:function` from the working directory scoring a JSONL task's
responses, sync or async, weighted parts, and every way one can fail counted, never raised."""

import json
import textwrap
import time

import pytest

from dorarl.errors import UserInputError
from dorarl.tasks import make_task, score
from dorarl.tasks.chartok import build_char_tokenizer
from dorarl.tasks.scoring import score_all
from dorarl.tasks.user_rewards import Rewards, RewardSpec, parse_reward_specs


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory the rewards' modules are written to (and imported from)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _module(workdir, name, source):
    (workdir / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def _task(workdir):
    rows = [
        {"prompt": "1+1=", "answer": "2", "bonus": 3},
        {"prompt": "2+2=", "answer": "4", "bonus": 5},
    ]
    path = workdir / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return make_task(
        "jsonl", path=path, tokenizer=build_char_tokenizer(), max_model_len=64,
        max_new_tokens=16, eval_fraction=0.0, shuffle=False,
    )  # fmt: skip


def _ids(task, text):
    return task.tokenizer(text, add_special_tokens=False)["input_ids"]


def _scored(task, specs, responses, timeout_s=5.0):
    task.user_rewards = Rewards(specs, timeout_s)
    prompts = task.train_prompts()
    return score_all(task, [(prompts[i], _ids(task, text)) for i, text in responses])


def test_a_module_function_reads_the_whole_row_the_response_and_its_ids(workdir):
    _module(workdir, "rw_row", """
        def reward(row, response, response_ids):
            assert isinstance(response_ids, list) and response_ids
            return float(row["bonus"]) if response.strip() == row["answer"] else 0.0
    """)  # fmt: skip
    task = _task(workdir)
    assert task.train_prompts()[0].row == {"prompt": "1+1=", "answer": "2", "bonus": 3}
    scored = _scored(task, [RewardSpec("rw_row:reward")], [(0, "2"), (1, "4"), (1, "7")])
    assert [(s.reward, s.error, s.parts) for s in scored] == [
        (3.0, None, {"reward": 3.0}),
        (5.0, None, {"reward": 5.0}),
        (0.0, None, {"reward": 0.0}),
    ]
    assert score(task, task.train_prompts()[0], _ids(task, "2")) == (3.0, None)


def test_an_async_reward_taking_a_subset_of_the_arguments(workdir):
    _module(workdir, "rw_async", """
        import asyncio

        async def judged(response, answer):
            await asyncio.sleep(0.01)
            return response.strip() == answer
    """)  # fmt: skip
    scored = _scored(_task(workdir), [RewardSpec("rw_async:judged")], [(0, "2"), (0, "3")])
    assert [(s.reward, s.error) for s in scored] == [(1.0, None), (0.0, None)]


def test_dict_parts_and_weights_sum_to_the_reward_each_part_kept_by_name(workdir):
    _module(workdir, "rw_parts", """
        def parts(response, answer):
            return {"format": 1.0 if response.strip().isdigit() else 0.0,
                    "correct": float(response.strip() == answer)}
    """)  # fmt: skip
    specs = parse_reward_specs("rw_parts:parts*0.5,exact*2")
    assert specs == [RewardSpec("rw_parts:parts", 0.5), RewardSpec("exact", 2.0)]
    scored = _scored(_task(workdir), specs, [(0, "2"), (0, "3"), (0, "x")])
    assert [(s.reward, s.parts) for s in scored] == [
        (3.0, {"format": 1.0, "correct": 1.0, "exact": 1.0}),
        (0.5, {"format": 1.0, "correct": 0.0, "exact": 0.0}),
        (0.0, {"format": 0.0, "correct": 0.0, "exact": 0.0}),
    ]
    listed = [{"fn": "rw_parts:parts", "weight": 0.5}, {"fn": "exact", "weight": 2}]
    assert parse_reward_specs(listed) == specs


@pytest.mark.parametrize(
    "written",
    ["rw_parts:parts*x", "", [{"fn": "exact", "weight": "nan"}], [{"fn": "exact", "w": 1}]],
)
def test_a_malformed_rewards_key_is_one_line_naming_it(written):
    with pytest.raises(UserInputError, match=r"^task.rewards"):
        parse_reward_specs(written)


def test_raising_hanging_nan_and_non_number_rewards_are_errors_the_run_survives(workdir, caplog):
    _module(workdir, "rw_bad", """
        import time

        def raises(response):
            raise RuntimeError("boom")

        def hangs(response):
            time.sleep(3600)

        def nan(response):
            return float("nan")

        def word(response):
            return "high"

        def good(response):
            return 1
    """)  # fmt: skip
    task = _task(workdir)
    started = time.monotonic()
    errors = []
    for fn in ("raises", "hangs", "nan", "word"):
        (scored,) = _scored(task, [RewardSpec(f"rw_bad:{fn}")], [(0, "2")], timeout_s=0.3)
        assert scored.reward == 0.0 and scored.parts == {}
        errors.append(scored.error)
    assert time.monotonic() - started < 5.0  # the hanging one waited its bound, no more
    assert errors[0] == "RuntimeError: boom"
    assert errors[1].startswith("TimeoutError: took over 0.3 s")
    assert "not finite" in errors[2] and "str, not a number" in errors[3]
    assert [r.getMessage() for r in caplog.records if "reward" in r.getMessage()][:1]
    (ok,) = _scored(task, [RewardSpec("rw_bad:good")], [(0, "2")], timeout_s=0.3)
    assert (ok.reward, ok.error) == (1.0, None)


def test_a_missing_module_or_function_or_argument_is_one_line_naming_it(workdir):
    _module(workdir, "rw_sig", """
        def extra(response, judge):
            return 1.0

        not_callable = 3
    """)  # fmt: skip
    for spec, message in (
        ("rw_nomodule_xyz:f", "cannot import module 'rw_nomodule_xyz'"),
        ("rw_sig:missing", "module 'rw_sig' has no function 'missing'"),
        ("rw_sig:not_callable", "module 'rw_sig' has a non-callable 'not_callable'"),
        ("rw_sig:extra", "rw_sig:extra takes 'judge'"),
        ("bogus", "unknown reward 'bogus'"),
    ):
        with pytest.raises(UserInputError, match=f"^task.reward: {message}"):
            Rewards([RewardSpec(spec)], 1.0)


def test_rewards_travel_as_their_specs_and_load_again(workdir):
    import pickle

    _module(workdir, "rw_pickle", "def reward(response):\n    return 2\n")
    rewards = Rewards([RewardSpec("rw_pickle:reward", 0.5)], 1.0)
    rewards.score([])  # its pool started: still picklable
    again = pickle.loads(pickle.dumps(rewards))
    assert again.specs == rewards.specs and again.terms[0].fn.__name__ == "reward"
