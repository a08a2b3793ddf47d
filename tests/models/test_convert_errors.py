"""Refusals: one line, exit 2, nothing written."""

import gguf
import pytest
from tiny_gguf import tiny_model, write_gguf, write_raw_type_gguf

from dorarl.cli import main
from dorarl.errors import UserInputError
from dorarl.models.convert import convert_gguf

Q = gguf.GGMLQuantizationType


def _one_line_exit_2(capsys, argv: list[str], *needles: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dorarl: error:"), err
    for needle in needles:
        assert needle in err, err


def test_unsupported_quantization_is_refused(tmp_path, capsys):
    path = write_raw_type_gguf(tmp_path / "iq.gguf", "llama", Q.IQ4_NL)
    out = tmp_path / "out"
    _one_line_exit_2(capsys, ["model", "convert", str(path), "--out", str(out)], "IQ4_NL")
    assert not out.exists()


def test_unsupported_architecture_is_refused(tmp_path, capsys):
    path = write_gguf(tmp_path / "g.gguf", tiny_model("llama"), arch_name="gemma")
    out = tmp_path / "out"
    argv = ["model", "convert", str(path), "--out", str(out)]
    _one_line_exit_2(capsys, argv, "architecture 'gemma' is not supported", "llama, qwen2")
    assert not out.exists()


def test_non_empty_out_is_refused(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _one_line_exit_2(capsys, ["model", "convert", str(path), "--out", str(out)], "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_out_that_is_a_file_is_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserInputError, match="not a folder"):
        convert_gguf(path, tmp_path / "file")


def test_a_file_that_is_not_gguf_is_refused(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    argv = ["model", "convert", str(bad), "--out", str(tmp_path / "out")]
    _one_line_exit_2(capsys, argv, "not a GGUF file")
    _one_line_exit_2(
        capsys, ["model", "convert", str(tmp_path / "none.gguf"), "--out", "x"], "no such file"
    )


def test_unknown_model_name_is_refused_before_any_download(tmp_path, capsys):
    argv = ["model", "get", "gpt-5", "--out", str(tmp_path / "out")]
    _one_line_exit_2(capsys, argv, "'gpt-5' is not known", "smollm2-135m-instruct")
    out = tmp_path / "full"
    out.mkdir()
    (out / "x").write_text("x")
    argv = ["model", "get", "smollm2-135m-instruct", "--out", str(out)]
    _one_line_exit_2(capsys, argv, "not empty")
