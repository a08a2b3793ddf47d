"""The JSONL task: loading, held-out split, file:line errors, context limit, rewards."""

import json

import pytest

from dorarl.errors import UserInputError
from dorarl.tasks import make_task, score
from dorarl.tasks.chartok import build_char_tokenizer


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def _task(path, **kw):
    kw.setdefault("tokenizer", build_char_tokenizer())
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_new_tokens", 16)
    return make_task("jsonl", path=path, **kw)


def _rows(n):
    return [json.dumps({"prompt": f"q{i}?", "answer": str(i)}) for i in range(n)]


def test_loads_rows_splits_a_seeded_held_out_set(tmp_path):
    path = _write(tmp_path / "d.jsonl", _rows(20) + [""])
    task = _task(path, eval_fraction=0.25, seed=1)
    train, held = task.train_prompts(), task.eval_prompts()
    assert len(train) == 15 and len(held) == 5
    assert {p.text for p in train}.isdisjoint(p.text for p in held)
    assert [p.text for p in held] == [
        p.text for p in _task(path, eval_fraction=0.25, seed=1).eval_prompts()
    ]
    assert train[0].prompt_ids[0] == task.tokenizer.bos_token_id


def test_training_rows_come_in_an_order_drawn_from_the_seed(tmp_path):
    path = _write(tmp_path / "d.jsonl", _rows(40))
    texts = [f"q{i}?" for i in range(40)]

    def order(**kw):
        return [p.text for p in _task(path, eval_fraction=0.0, **kw).train_prompts()]

    assert order(shuffle=False) == texts  # the file's order
    seed_0 = order(seed=0)
    assert sorted(seed_0) == sorted(texts) and seed_0 != texts  # every row once, reordered
    assert order(seed=0) == seed_0 and order(seed=1) != seed_0  # a function of the seed
    # the held-out set is the split's, whatever the training order
    kept = [p.text for p in _task(path, eval_fraction=0.25, seed=3).eval_prompts()]
    assert kept == [
        p.text for p in _task(path, eval_fraction=0.25, seed=3, shuffle=False).eval_prompts()
    ]


def test_separate_eval_file_and_numeric_answers(tmp_path):
    train = _write(tmp_path / "t.jsonl", _rows(3))
    held = _write(tmp_path / "e.jsonl", [json.dumps({"prompt": "2+2", "answer": 4})])
    task = _task(train, eval_path=held)
    assert len(task.train_prompts()) == 3
    (prompt,) = task.eval_prompts()
    assert prompt.answer == "4" and prompt.prompt_id == 3


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "x", "answer": "1"', "invalid JSON"),
        ('["x", "1"]', "expected a JSON object"),
        ('{"answer": "1"}', "missing field 'prompt'"),
        ('{"prompt": "x"}', "missing field 'answer'"),
        ('{"prompt": 5, "answer": "1"}', "'prompt' must be a string"),
        ('{"prompt": "x", "answer": null}', "'answer' must be a string or a number"),
        ('{"prompt": "x", "answer": true}', "'answer' must be a string or a number"),
        ('{"prompt": "", "answer": "1"}', "field 'prompt' is empty"),
        ('{"prompt": " \\n", "answer": "1"}', "field 'prompt' is empty"),
        ('{"prompt": "x", "answer": ""}', "field 'answer' is empty"),
        ('{"prompt": "x", "answer": "  "}', "field 'answer' is empty"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path / "bad.jsonl", _rows(2) + ["", bad_line])
    with pytest.raises(UserInputError, match=message) as info:
        _task(path)
    assert f"{path}:4:" in str(info.value)


def test_prompt_over_the_context_limit_names_file_and_line(tmp_path):
    path = _write(
        tmp_path / "long.jsonl", _rows(1) + [json.dumps({"prompt": "x" * 60, "answer": "1"})]
    )
    with pytest.raises(UserInputError, match="exceeds the context limit of 64") as info:
        _task(path)
    assert f"{path}:2:" in str(info.value)
    # the keys that set the limit, so the fix is one override away
    assert "raise engine.max_model_len" in str(info.value)
    assert "sampling.max_new_tokens" in str(info.value)


def test_missing_or_empty_file_and_unknown_reward(tmp_path):
    with pytest.raises(UserInputError, match="no such data file"):
        _task(tmp_path / "nope.jsonl")
    with pytest.raises(UserInputError, match="no rows"):
        _task(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(UserInputError, match="unknown reward"):
        _task(_write(tmp_path / "d.jsonl", _rows(2)), reward="fuzzy")
    with pytest.raises(UserInputError, match="unknown task"):
        make_task("nope")


def test_math_reward_through_the_task_and_a_bad_reference_is_a_counted_error(tmp_path):
    rows = [
        json.dumps({"prompt": "half?", "answer": "\\frac{1}{2}"}),
        json.dumps({"prompt": "bad", "answer": "@@@"}),
    ]
    task = _task(_write(tmp_path / "m.jsonl", rows), reward="math", eval_fraction=0.0,
                 shuffle=False)  # fmt: skip
    half, bad = task.train_prompts()
    ids = task.tokenizer("0.5", add_special_tokens=False)["input_ids"] + task.stop_token_ids
    assert score(task, half, ids) == (1.0, None)
    reward, error = score(task, bad, ids)
    assert reward == 0.0 and error.startswith("ValueError: reference answer")


def test_defaults_to_the_shipped_base_model_tokenizer(tmp_path):
    task = make_task("jsonl", path=_write(tmp_path / "d.jsonl", _rows(4)))
    assert task.tokenizer.get_vocab() == build_char_tokenizer().get_vocab()
    assert task.stop_token_ids == [task.tokenizer.eos_token_id]
    assert task.max_model_len == 512
