"""What `dorarl model get/convert` prints: the folder, its files, the model's shape."""

from __future__ import annotations

from dorarl.engine.model_spec import spec_from_hf
from dorarl.models.convert import SUPPORTED_GGML_TYPES, ConvertedModel


def summary_lines(converted: ConvertedModel, source: str | None = None) -> list[str]:
    config = converted.model.config
    spec = spec_from_hf(config)
    tokenizer = converted.tokenizer
    types = sorted({SUPPORTED_GGML_TYPES[t.ggml_type] for t in converted.header.tensors})
    lines = [
        f"wrote {converted.folder}",
        f"  from {source or converted.header.path} ({converted.header.architecture}, {', '.join(types)})",
        f"  {config.model_type}: {spec.num_parameters() / 1e6:.1f}M parameters, "
        f"{spec.num_layers} layers, {spec.num_heads}/{spec.num_kv_heads} heads "
        f"(head_dim {spec.head_dim}), hidden {spec.hidden_size}, vocabulary {spec.vocab_size}, "
        f"tied embeddings {spec.tie_word_embeddings}, float32",
        f"  tokenizer: EOS {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}), "
        f"chat template {'yes' if tokenizer.chat_template else 'no'}",
    ]
    for path in converted.files():
        lines.append(f"  {path.name:<26} {path.stat().st_size / 1e6:9.2f} MB")
    return lines
