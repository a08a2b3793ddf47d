"""Hugging Face data sets as the jsonl task's data: a save_to_disk folder, its splits, a name
in the datasets cache, and a name held nowhere here (one line, no hub call)."""

import json
import time

import pytest

from dorarl.errors import UserInputError
from dorarl.tasks import make_task
from dorarl.tasks.chartok import build_char_tokenizer

datasets = pytest.importorskip("datasets")

ROWS = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i}\n#### {2 * i}"} for i in range(6)]


def _task(path, **kw):
    kw.setdefault("tokenizer", build_char_tokenizer())
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("format", "gsm8k")
    kw.setdefault("shuffle", False)  # rows in the file's order, as the tests index them
    return make_task("jsonl", path=path, **kw)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_saved_data_set_loads_as_its_jsonl_file_does(tmp_path):
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    saved = _task(folder, eval_fraction=0.0)
    from_file = _task(_jsonl(tmp_path / "d.jsonl", ROWS), eval_fraction=0.0)
    assert saved.train_prompts() == from_file.train_prompts()
    with pytest.raises(UserInputError, match="has no final answer") as info:
        datasets.Dataset.from_list([*ROWS, {"question": "q", "answer": "x"}]).save_to_disk(
            str(tmp_path / "bad")
        )
        _task(tmp_path / "bad")
    assert str(info.value).startswith(f"{tmp_path / 'bad'} row 7: ")


def test_a_saved_dict_of_splits_takes_the_split_keys(tmp_path):
    folder = tmp_path / "dict"
    splits = {"train": ROWS[:4], "test": ROWS[4:]}
    datasets.DatasetDict(
        {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
    ).save_to_disk(str(folder))
    with pytest.raises(UserInputError) as info:
        _task(folder)
    assert str(info.value) == (
        f"task.split: {folder} has several splits; choose one of train, test with task.split=NAME"
    )
    task = _task(folder, split="train", eval_path=folder, eval_split="test")
    assert [p.answer for p in task.train_prompts()] == ["0", "2", "4", "6"]
    assert [p.answer for p in task.eval_prompts()] == ["8", "10"]
    with pytest.raises(UserInputError, match="^task.eval_split: .* has no split dev; choose"):
        _task(folder, split="train", eval_path=folder, eval_split="dev")


def _cache_entry(tmp_path, monkeypatch, name: str):
    """A data set prepared in a datasets cache as a hub download leaves it: the cache's
    `namespace___name/config/version/hash` folder."""
    source = tmp_path / "src" / name.split("/")[-1]
    source.mkdir(parents=True)
    _jsonl(source / "train.jsonl", ROWS)
    cache = tmp_path / "cache"
    datasets.load_dataset(str(source), cache_dir=str(cache))
    (cache / source.name).rename(cache / name.replace("/", "___"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    return cache


def test_a_name_in_the_datasets_cache_loads_offline(tmp_path, monkeypatch):
    _cache_entry(tmp_path, monkeypatch, "myorg/tiny_sums")
    task = _task("myorg/tiny_sums", eval_fraction=0.0)
    assert [p.answer for p in task.train_prompts()] == [str(2 * i) for i in range(6)]
    assert task.train_prompts()[0].row == ROWS[0]


def test_a_name_held_nowhere_is_one_line_with_no_hub_call(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))

    def no_hub(*args, **kwargs):
        raise AssertionError("load_dataset called for a name not held here")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    start = time.monotonic()
    with pytest.raises(UserInputError) as info:
        _task("openai/gsm8k")
    assert time.monotonic() - start < 5.0
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("task.path: no such data file openai/gsm8k, nor a data set")
    assert str(cache / "openai___gsm8k") in message
