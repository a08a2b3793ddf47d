"""A GGUF file of a supported family (llama, qwen2) into a Hugging Face model folder.

transformers reads the file (tokenizer, config, weights dequantized to float32); we check
the header first, so an unsupported architecture or quantization is refused in a fraction
of a second with one line, and write config.json (without the GGUF `quantization_config`),
model.safetensors (tied embeddings stored once, the Hugging Face layout), the tokenizer
with its chat template, and generation_config.json with the EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from dorarl.engine.model_spec import spec_from_hf
from dorarl.engine.weights import check_named
from dorarl.errors import UserInputError
from dorarl.models.gguf_header import GGUFHeader, read_header
from dorarl.models.output_dir import check_out_dir, staged_out_dir

# GGUF architectures converted and checked end to end (the engine runs qwen3 folders too,
# but no qwen3 GGUF goes through this converter's tests yet).
GGUF_FAMILIES = ("llama", "qwen2")
# Types that gguf dequantizes and that llama.cpp uses for whole models (F32..Q6_K);
# the importance-matrix (IQ*), ternary and FP4 types are refused up front.
SUPPORTED_GGML_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    30: "BF16",
}


@dataclass
class ConvertedModel:
    folder: Path
    model: PreTrainedModel  # as transformers loaded it from the GGUF (float32)
    tokenizer: PreTrainedTokenizerBase
    header: GGUFHeader

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir() if p.is_file())


def check_gguf(header: GGUFHeader) -> None:
    """Refuse, in one line, what the engine cannot run or gguf cannot dequantize."""
    arch = header.architecture
    if arch not in GGUF_FAMILIES:
        raise UserInputError(
            f"{header.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_FAMILIES)})"
        )
    for tensor in header.tensors:
        if tensor.ggml_type not in SUPPORTED_GGML_TYPES:
            raise UserInputError(
                f"{header.path}: tensor {tensor.name!r} has quantization "
                f"{_type_name(tensor.ggml_type)}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_GGML_TYPES.values())})"
            )


def _type_name(ggml_type: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"ggml type {ggml_type}"


def require_gguf_support() -> None:
    """transformers reads GGUF only with the `gguf` package (and loads with `accelerate`)."""
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UserInputError(
            f"reading GGUF needs {' and '.join(missing)}: pip install 'dorarl[real]'"
        )


def convert_gguf(gguf_path: str | Path, out: str | Path) -> ConvertedModel:
    """Convert `gguf_path` into the new or empty folder `out`."""
    out_dir = check_out_dir(out)
    header = read_header(gguf_path)
    check_gguf(header)
    require_gguf_support()
    model, tokenizer = load_gguf(Path(gguf_path))
    # Settings the engine cannot run, and weights that did not come out as plain floats
    # under Hugging Face names (a loader that kept them packed).
    spec = spec_from_hf(model.config, where=str(gguf_path))
    check_named(spec, model.state_dict(), f"{gguf_path}: weights")
    eos = header.metadata.get("tokenizer.ggml.eos_token_id")
    with staged_out_dir(out_dir) as staging:
        save_folder(model, tokenizer, staging, eos=None if eos is None else int(eos))
    return ConvertedModel(out_dir, model, tokenizer, header)


def load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    folder, name = str(path.resolve().parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # dequantized on load; saving must not claim otherwise
        quantizer.remove_quantization_config(model)
    return model.eval(), tokenizer


def save_folder(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
    eos: int | None = None,
) -> None:
    """The Hugging Face layout, with nothing left that says "GGUF". `eos`: the GGUF's own
    EOS id, which wins over what a transformers version's GGUF tokenizer loader made of it
    (5.17 maps some files' EOS to another token)."""
    if eos is not None and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _drop_quantization_config(folder / "config.json")
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    generation = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else eos,
    )
    generation.save_pretrained(folder)


def _drop_quantization_config(path: Path) -> None:
    # The weights are plain float32 now; a `quantization_config` would send transformers
    # looking for the GGUF file again.
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
