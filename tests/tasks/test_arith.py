"""The arith task: chat-rendered word problems, seeded, a disjoint held-out set, final-answer reward."""

import random
import re

import pytest

from dorarl.errors import UserInputError
from dorarl.tasks import make_task, score
from dorarl.tasks.arith import ArithConfig, Problem, count_problems, draw_problem
from dorarl.tasks.assets import BASE_MODEL_DIR
from dorarl.tasks.chartok import build_char_tokenizer
from dorarl.tasks.evaluate import _summarise

SUM = re.compile(
    r"(?:What is|Calculate) (\d+) plus (\d+)|Add (\d+) and (\d+)|sum of (\d+) and (\d+)"
)
DIFFERENCE = re.compile(r"(\d+) minus (\d+)|Subtract (\d+) from (\d+)|Take (\d+) away from (\d+)")


def _problem(text: str) -> Problem:
    """The problem a question asks, read back from its words."""
    if match := SUM.search(text):
        a, b = (int(g) for g in match.groups() if g is not None)
        return Problem("+", a, b)
    match = DIFFERENCE.search(text)
    assert match, text
    a, b = (int(g) for g in match.groups() if g is not None)
    return Problem("-", a, b) if "minus" in text else Problem("-", b, a)


def _task(tokenizer, **options):
    options.setdefault("n_train", 2000)
    options.setdefault("n_eval", 200)
    options.setdefault("max_model_len", 256)
    return make_task("arith", tokenizer=tokenizer, **options)


@pytest.fixture(scope="module")
def task(chat_tokenizer):
    return _task(chat_tokenizer)


def _ids(task, text):
    return task.tokenizer(text, add_special_tokens=False)["input_ids"] + task.stop_token_ids[:1]


def test_prompts_are_questions_in_words_rendered_through_the_chat_template(chat_tokenizer):
    task = _task(chat_tokenizer, system_prompt="Answer briefly.")
    for prompt in task.train_prompts()[:50] + task.eval_prompts()[:50]:
        messages = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": prompt.text},
        ]
        expected = chat_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert prompt.prompt_ids == list(expected)
        problem = _problem(prompt.text)
        assert prompt.answer == str(problem.result)
        assert problem.result not in (problem.a, problem.b)  # restating never scores
    texts = [p.text for p in task.train_prompts()]
    assert any("plus" in t for t in texts) and any("Subtract" in t for t in texts)
    assert len({re.sub(r"\d+", "N", t) for t in texts}) == 8  # every phrasing is used


def test_the_template_default_system_message_is_kept_without_a_system_prompt(task):
    prompt = task.train_prompts()[0]
    rendered = task.tokenizer.decode(prompt.prompt_ids)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant.")
    assert rendered.endswith(f"{prompt.text}<|im_end|>\n<|im_start|>assistant\n")


def test_prompts_are_seeded(chat_tokenizer, task):
    first, again, other = task, _task(chat_tokenizer, seed=0), _task(chat_tokenizer, seed=1)
    assert first.train_prompts() == again.train_prompts()
    assert first.eval_prompts() == again.eval_prompts()
    assert [p.text for p in first.train_prompts()] != [p.text for p in other.train_prompts()]


def test_no_held_out_problem_is_ever_a_training_prompt_in_any_order_or_phrasing(chat_tokenizer):
    task = _task(chat_tokenizer, min_value=1, max_value=20, n_train=3000, n_eval=100)
    held_out = {_problem(p.text).key() for p in task.eval_prompts()}
    assert len(held_out) == len(task.eval_prompts()) == 100  # distinct problems
    assert not held_out & {_problem(p.text).key() for p in task.train_prompts()}
    ids = [p.prompt_id for p in task.train_prompts() + task.eval_prompts()]
    assert len(set(ids)) == len(ids)


def test_the_held_out_set_does_not_depend_on_the_training_set_size(chat_tokenizer, task):
    small, large = _task(chat_tokenizer, n_train=100), task
    assert [p.text for p in small.eval_prompts()] == [p.text for p in large.eval_prompts()]


def test_operands_stay_in_the_configured_range(chat_tokenizer):
    task = _task(chat_tokenizer, min_value=100, max_value=999)
    for prompt in task.train_prompts():
        problem = _problem(prompt.text)
        assert min(problem.a, problem.b) >= 100 and max(problem.a, problem.b) <= 999
        assert problem.result >= 0


@pytest.mark.parametrize(("lo", "hi"), [(0, 1), (0, 7), (1, 9), (3, 12), (5, 6)])
def test_count_problems_matches_an_enumeration(lo, hi):
    cfg = ArithConfig(min_value=lo, max_value=hi)
    keys = {
        Problem(op, a, b).key()
        for op in "+-"
        for a in range(lo, hi + 1)
        for b in range(lo, hi + 1)
        if (op == "+" or a >= b) and Problem(op, a, b).result not in (a, b)
    }
    assert count_problems(lo, hi) == len(keys)
    rng = random.Random(0)
    assert {draw_problem(rng, cfg).key() for _ in range(2000)} == keys


def test_a_small_range_holds_out_a_quarter_and_a_tiny_one_is_refused(chat_tokenizer):
    task = _task(chat_tokenizer, min_value=1, max_value=9, n_eval=500)
    assert len(task.eval_prompts()) == count_problems(1, 9) // 4
    with pytest.raises(UserInputError, match="too few to hold some out"):
        _task(chat_tokenizer, min_value=0, max_value=1)
    with pytest.raises(UserInputError, match="task arith: need 0 <= min_value < max_value"):
        _task(chat_tokenizer, min_value=5, max_value=5)


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("The answer is {answer}.", 1.0),
        ("\\boxed{{{answer}}}", 1.0),
        ("{a} {op} {b} = {answer}", 1.0),
        ("{answer} = {a} {op} {b}", 1.0),
        ("{a} {op} {b} = {answer}. Let me know if you need more help!", 1.0),
        ("{a} {op} {b} = ?", 0.0),  # the restated question
        ("{question}", 0.0),
        ("The answer is {a} {op} {b}.", 0.0),
        ("The answer is {wrong}.", 0.0),
        ("{answer} or {wrong}? I would say {wrong}", 0.0),
    ],
)
def test_reward_is_on_the_final_answer(task, response, reward):
    for prompt in task.eval_prompts()[:20]:
        problem = _problem(prompt.text)
        op = "+" if problem.op == "+" else "-"
        text = response.format(
            answer=prompt.answer, a=problem.a, b=problem.b, op=op, question=prompt.text,
            wrong=problem.result + 1,
        )  # fmt: skip
        assert score(task, prompt, _ids(task, text)) == (reward, None), text


def test_held_out_accuracy_uses_the_same_extraction(task):
    prompts = task.eval_prompts()[:4]
    texts = [
        f"The answer is {prompts[0].answer}.",
        f"{_problem(prompts[1].text).a} {_problem(prompts[1].text).op} "
        f"{_problem(prompts[1].text).b} = ?",
        prompts[2].text,
        f"\\boxed{{{prompts[3].answer}}}",
    ]
    result = _summarise(task, [(p, _ids(task, t)) for p, t in zip(prompts, texts, strict=True)])
    assert result["accuracy"] == 0.5 and result["reward_errors"] == 0


def test_a_model_folder_gives_its_generation_eos_and_context_limit(tiny_chat_model_dir):
    task = make_task("arith", tokenizer=str(tiny_chat_model_dir), n_train=50, n_eval=10)
    assert task.stop_token_ids == [task.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert task.max_model_len == 256


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line():
    with pytest.raises(UserInputError) as info:
        make_task("arith", tokenizer=str(BASE_MODEL_DIR))
    message = str(info.value)
    assert "task.name=arith" in message and str(BASE_MODEL_DIR) in message
    assert "\n" not in message
    with pytest.raises(UserInputError, match="task.name=arith"):
        make_task("arith", tokenizer=build_char_tokenizer())


def test_prompts_that_leave_no_room_for_the_response_are_refused(chat_tokenizer):
    with pytest.raises(UserInputError, match="exceed the context limit of 100 tokens") as info:
        _task(chat_tokenizer, max_model_len=100, max_new_tokens=64, n_train=50, n_eval=10)
    assert "raise engine.max_model_len" in str(info.value)


def test_evaluation_through_the_engine_on_a_chat_model(tiny_chat_model_dir):
    from dorarl.engine import Engine, EngineConfig
    from dorarl.tasks.evaluate import evaluate

    task = make_task(
        "arith", tokenizer=str(tiny_chat_model_dir), n_train=50, n_eval=10, max_new_tokens=16
    )
    engine = Engine.from_pretrained(tiny_chat_model_dir, EngineConfig(max_model_len=256))
    result = evaluate(engine, task, max_prompts=8)
    assert result["n"] == 8 and result["reward_errors"] == 0
    assert 0 <= result["accuracy"] <= 1 and 0 < result["mean_len"] <= 16
