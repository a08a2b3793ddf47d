"""Tiny GGUF files written here with gguf's GGUFWriter, laid out as llama.cpp writes them.

A random Llama or Qwen2 with a byte-level BPE vocabulary (ChatML specials, a few merges)
and a ChatML template; weights in F32 or Q8_0. Llama's q/k rows are permuted the way
llama.cpp's converter does, so a loader that forgets to undo it gives other logits.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i s"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def vocabulary() -> list[str]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    return SPECIALS + byte_tokens() + merged


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    common = dict(
        vocab_size=len(vocabulary()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0)).eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary halves)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    arch_name: str | None = None,
) -> Path:
    """Write `model` (a tiny_model) as llama.cpp would; `arch_name` overrides the stated arch."""
    config = model.config
    family = config.model_type
    arch = arch_name or family
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(int(quant))
    _add_tokenizer(writer)
    _add_tensors(writer, model, family, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    tokens = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def _add_tensors(writer, model, family: str, quant) -> None:
    config = model.config
    names = gguf.get_tensor_name_map(_ARCH[family], config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":  # tied: llama.cpp writes no output tensor
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.detach().float().numpy()
        if family == "llama" and base.endswith("self_attn.q_proj"):
            data = _permute(data, config.num_attention_heads)
        elif family == "llama" and base.endswith("self_attn.k_proj"):
            data = _permute(data, config.num_key_value_heads)
        name = f"{names.get_name(base)}.{suffix}"
        if data.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, data)


def write_raw_type_gguf(path: Path, family: str, ggml_type: gguf.GGMLQuantizationType) -> Path:
    """A tiny GGUF whose matrices claim `ggml_type` (zero bytes): enough to test refusals."""
    model = tiny_model(family)
    config = model.config
    writer = gguf.GGUFWriter(str(path), family)
    writer.add_block_count(config.num_hidden_layers)
    _add_tokenizer(writer)
    names = gguf.get_tensor_name_map(_ARCH[family], config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if tensor.ndim == 2:
            shape = gguf.quant_shape_to_byte_shape(tuple(tensor.shape), ggml_type)
            writer.add_tensor(name, np.zeros(shape, dtype=np.uint8), raw_dtype=ggml_type)
        else:
            writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
