"""A model folder's tokenizer: one that cannot load for want of its files says which files
and which folder, in one line."""

from __future__ import annotations

import pytest

from dorarl.errors import UserInputError
from dorarl.tasks.model_files import load_tokenizer, missing_tokenizer_files


def test_a_folder_without_tokenizer_files_names_them(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    with pytest.raises(UserInputError) as refused:
        load_tokenizer(tmp_path)
    message = str(refused.value)
    assert message == (
        f"{tmp_path}: cannot load a tokenizer: no tokenizer_config.json and none of "
        "tokenizer.json, tokenizer.model, vocab.json, vocab.txt; copy the tokenizer files "
        "from the folder its weights came from"
    )


def test_a_vocabulary_of_any_kind_counts_as_tokenizer_files(tmp_path, tiny_model_dir):
    assert missing_tokenizer_files(tiny_model_dir) is None
    for name in ("spiece.model", "qwen.tiktoken", "vocab.json"):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        assert missing_tokenizer_files(folder) is not None
        (folder / name).write_text("")
        assert missing_tokenizer_files(folder) is None, name


def test_a_model_without_a_context_limit_names_the_key_that_sets_one(tmp_path):
    from types import SimpleNamespace

    from dorarl.tasks.model_files import context_limit

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserInputError, match="set engine.max_model_len$"):
        context_limit(tmp_path, SimpleNamespace(model_max_length=10**30))
