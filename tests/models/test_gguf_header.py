"""The header reader agrees with gguf's own reader on a file gguf's writer wrote."""

import gguf
from tiny_gguf import tiny_model, vocabulary, write_gguf

from dorarl.models.gguf_header import read_header


def test_header_matches_gguf_reader(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("qwen2"), gguf.GGMLQuantizationType.Q8_0)
    header = read_header(path)
    reader = gguf.GGUFReader(str(path))
    assert header.architecture == "qwen2" and header.version == 3
    assert header.metadata["qwen2.block_count"] == 2
    assert header.metadata["tokenizer.ggml.tokens"] == len(vocabulary())  # skipped, counted
    assert header.metadata["tokenizer.chat_template"].startswith("{% for message")
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    assert [t.ggml_type for t in header.tensors] == [int(t.tensor_type) for t in reader.tensors]
    by_name = {t.name: t.shape for t in header.tensors}
    assert by_name["token_embd.weight"] == (len(vocabulary()), 64)
    assert by_name["blk.0.ffn_down.weight"] == (64, 128)
