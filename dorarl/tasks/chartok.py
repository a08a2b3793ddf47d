"""The built-in character-level tokenizer: one token per printable ASCII character.

Invariant: ids are fixed by construction (specials first, then the characters in code-point
order), so a tokenizer built here and the copy shipped with the base model agree id for id.
Built with the `tokenizers` library and wrapped as a transformers fast tokenizer, so
`AutoTokenizer.from_pretrained(folder)` loads a saved copy offline.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]


def char_vocab() -> dict[str, int]:
    return {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A fast tokenizer that splits text into single characters and prepends <bos>."""
    vocab = char_vocab()
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token, newlines included ([\s\S] rather than ".").
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )


def save_char_tokenizer(folder: str | Path) -> None:
    build_char_tokenizer().save_pretrained(str(folder))
