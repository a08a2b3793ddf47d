"""Data formats of the jsonl task: gsm8k and math rows, prompt templates, chat and system
messages, Parquet files, and the errors that name the file and the row."""

import json
import sys

import pytest

from dorarl.errors import UserInputError
from dorarl.tasks import make_task, score
from dorarl.tasks.chartok import build_char_tokenizer

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 12 eggs. Two boxes?", "answer": "12 * 2 = 24\n#### 1,024"},
]
MATH = [
    {"problem": "Simplify 2/4.", "solution": "Divide: $\\boxed{\\frac{1}{2}}$.", "level": "1"},
    {"problem": "Root?", "solution": "So $x = \\boxed{\\frac{\\sqrt{2}}{2}}$ at last."},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _task(path, **kw):
    kw.setdefault("tokenizer", build_char_tokenizer())
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("eval_path", path)
    kw.setdefault("shuffle", False)  # rows in the file's order, as the tests index them
    return make_task("jsonl", path=path, **kw)


def _encode(task, text: str) -> list[int]:
    return task.tokenizer.encode(text)


def test_gsm8k_rows_give_the_question_and_the_number_after_the_mark(tmp_path):
    task = _task(_jsonl(tmp_path / "g.jsonl", GSM8K), format="gsm8k", reward="math")
    first, second = task.train_prompts()
    assert (first.text, first.answer) == (GSM8K[0]["question"], "7")
    assert second.answer == "1,024"
    assert score(task, first, _encode(task, "3 + 4 = 7, so\n#### 7")) == (1.0, None)
    assert score(task, first, _encode(task, "The answer is \\boxed{7}.")) == (1.0, None)
    assert score(task, first, _encode(task, "#### 8")) == (0.0, None)
    assert score(task, second, _encode(task, "#### 1024")) == (1.0, None)


def test_math_rows_give_the_last_boxed_answer_with_nested_braces(tmp_path):
    task = _task(_jsonl(tmp_path / "m.jsonl", MATH), format="math", reward="math")
    half, root = task.train_prompts()
    assert (half.text, half.answer) == ("Simplify 2/4.", "\\frac{1}{2}")
    assert root.answer == "\\frac{\\sqrt{2}}{2}"
    assert score(task, half, _encode(task, "It is \\boxed{0.5}")) == (1.0, None)
    assert score(task, half, _encode(task, "It is \\boxed{\\frac{2}{4}}")) == (1.0, None)
    assert score(task, half, _encode(task, "It is \\boxed{2}")) == (0.0, None)


def test_a_prompt_template_fills_in_the_rows_fields(tmp_path):
    template = "Level {level}: {problem}\nPut your final answer in \\boxed{{}}."
    task = _task(_jsonl(tmp_path / "m.jsonl", MATH[:1]), format="math", prompt_template=template)
    (prompt,) = task.train_prompts()
    assert prompt.text == "Level 1: Simplify 2/4.\nPut your final answer in \\boxed{}."
    assert prompt.prompt_ids == _encode(task, prompt.text)


@pytest.mark.parametrize(
    ("fmt", "row", "message"),
    [
        (
            "gsm8k",
            {"question": "q", "answer": "7"},
            "field 'answer' has no final answer after '####'",
        ),
        (
            "gsm8k",
            {"question": "q", "answer": "so\n####  "},
            "field 'answer' is empty after '####'",
        ),
        ("gsm8k", {"answer": "#### 7"}, "missing field 'question'"),
        ("gsm8k", {"question": 3, "answer": "#### 7"}, "field 'question' must be a string"),
        ("math", {"problem": "p", "solution": "it is 5"}, "has no closed \\\\boxed"),
        ("math", {"problem": "p", "solution": "\\boxed{5"}, "has no closed \\\\boxed"),
        ("math", {"problem": "p", "solution": "\\boxed{ }"}, "has an empty \\\\boxed"),
        ("math", {"problem": "p"}, "missing field 'solution'"),
        ("prompt_answer", {"question": "q", "answer": "1"}, "missing field 'prompt'"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, fmt, row, message):
    good = (
        GSM8K[0] if fmt == "gsm8k" else MATH[0] if fmt == "math" else {"prompt": "p", "answer": 1}
    )
    path = _jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(UserInputError, match=message) as info:
        _task(path, format=fmt)
    assert str(info.value).startswith(f"{path}:2: ")


def test_template_errors_name_the_key_or_the_row(tmp_path):
    path = _jsonl(tmp_path / "g.jsonl", GSM8K)
    with pytest.raises(UserInputError, match=r"^task.prompt_template: .*literal brace"):
        _task(path, format="gsm8k", prompt_template="{question")
    with pytest.raises(UserInputError, match=r"^task.prompt_template: name the row's fields"):
        _task(path, format="gsm8k", prompt_template="Q: {}")
    with pytest.raises(UserInputError, match="names field 'level', which the row lacks") as info:
        _task(path, format="gsm8k", prompt_template="{level}: {question}")
    assert str(info.value).startswith(f"{path}:1: ")


def test_chat_template_with_a_system_prompt(tmp_path, chat_tokenizer):
    path = _jsonl(tmp_path / "g.jsonl", GSM8K[:1])
    task = _task(path, format="gsm8k", tokenizer=chat_tokenizer, chat_template=True,
                 system_prompt="Think, then answer.")  # fmt: skip
    text = chat_tokenizer.decode(task.train_prompts()[0].prompt_ids)
    assert text.startswith("<|im_start|>system\nThink, then answer.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith(f"{GSM8K[0]['question']}<|im_end|>\n<|im_start|>assistant\n")
    default = _task(path, format="gsm8k", tokenizer=chat_tokenizer, chat_template=True)
    assert "You are a helpful AI assistant." in chat_tokenizer.decode(
        default.train_prompts()[0].prompt_ids
    )
    with pytest.raises(UserInputError, match="^task.system_prompt: .*chat_template=true"):
        _task(path, format="gsm8k", tokenizer=chat_tokenizer, system_prompt="x")


def _parquet(path, rows):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    pq.write_table(pyarrow.Table.from_pylist(rows), str(path))
    return path


def test_parquet_files_load_like_jsonl(tmp_path):
    parquet = _parquet(tmp_path / "g.parquet", GSM8K)
    jsonl = _jsonl(tmp_path / "g.jsonl", GSM8K)
    from_parquet = _task(parquet, format="gsm8k").train_prompts()
    assert from_parquet == _task(jsonl, format="gsm8k").train_prompts()


def test_a_malformed_parquet_row_names_file_and_row(tmp_path):
    rows = [GSM8K[0], GSM8K[1], {"question": "q", "answer": "no mark"}]
    path = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(UserInputError, match="has no final answer") as info:
        _task(path, format="gsm8k")
    assert str(info.value).startswith(f"{path} row 3: ")


def test_an_unreadable_parquet_file_is_named(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "broken.parquet"
    path.write_text("not parquet")
    with pytest.raises(UserInputError, match=f"^{path}: not a readable Parquet file"):
        _task(path)


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    path = tmp_path / "g.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import raises ImportError
    with pytest.raises(UserInputError, match=r"needs pyarrow; .*pip install 'dorarl\[data\]'"):
        _task(path)
