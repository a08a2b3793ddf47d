"""Tiny random models saved as HF folders for tests: Llamas with the built-in character
tokenizer or a ChatML character tokenizer, and Qwen2 / Qwen3 / Qwen3-MoE / Llama 3 folders
with a byte-level BPE tokenizer trained here (what a user's model folder looks like)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from dorarl.tasks.chartok import CHARACTERS, build_char_tokenizer

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# ChatML as SmolLM2-Instruct writes it, default system message included.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, plus ChatML's special tokens; EOS is <|im_end|>."""
    specials = [ENDOFTEXT, IM_START, IM_END]
    vocab = {token: i for i, token in enumerate(specials + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=ENDOFTEXT))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=ENDOFTEXT
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def save_tiny_model(
    folder: Path, seed: int = 0, max_len: int = 256, chat: bool = False, heads: int = 4
) -> Path:
    """A tiny random Llama (hidden 64: heads of 64 / `heads`) with a character tokenizer."""
    tokenizer = build_chat_tokenizer() if chat else build_char_tokenizer()
    tokenizer.save_pretrained(str(folder))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a strong EOS bias gives varied, long-tailed response lengths
        model.lm_head.weight[tokenizer.eos_token_id] *= 4
    model.save_pretrained(folder)
    return folder


def gsm8k_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """GSM8K-shaped rows (question; worked answer ending in `#### N`) of one-step sums."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        question = f"Sam has {a} apples and buys {b} more. How many apples does Sam have now?"
        answer = f"Sam has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"
        rows.append({"question": question, "answer": answer})
    return rows


def build_bpe_chat_tokenizer(corpus: list[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on `corpus` (as Qwen's and Llama 3's tokenizers are
    byte-level BPEs), with ChatML's special tokens and chat template; EOS is <|im_end|>."""
    specials = [ENDOFTEXT, IM_START, IM_END]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


FAMILY_CONFIGS = {
    "qwen2": lambda **kw: Qwen2Config(tie_word_embeddings=True, **kw),  # Qwen2.5 0.5B-3B tie
    "qwen3": lambda **kw: Qwen3Config(head_dim=16, **kw),
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **kw
    ),
    "llama3": lambda **kw: LlamaConfig(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        **kw,
    ),
}


def save_family_model(folder: Path, family: str, corpus: list[str], seed: int = 0) -> Path:
    """A random model of `family` (qwen2, qwen3, qwen3_moe, llama3) saved with
    `save_pretrained`, with a BPE chat tokenizer trained on `corpus`: the shape of a user's
    Hugging Face folder."""
    tokenizer = build_bpe_chat_tokenizer(corpus)
    tokenizer.save_pretrained(str(folder))
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    config = FAMILY_CONFIGS[family](
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # some responses end early, others run into the cap
        model.get_output_embeddings().weight[eos] *= 6
    model.save_pretrained(folder)
    return folder


def save_with_head_dim(source: Path, folder: Path, head_dim: int) -> Path:
    """A copy of the model folder `source` whose config.json says `head_dim` (its weights
    keep their own): a config that does not match its weights, or one Triton cannot run."""
    folder.mkdir()
    for item in source.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "head_dim": head_dim}))
    return folder


def save_calculator_model(folder: Path, seed: int = 0) -> Path:
    """A tiny Qwen2 that has learnt by heart one episode of the calculator task (its first
    training prompt at the default keys): the call, then, after the tool's result, the right
    answer. Saved with a BPE chat tokenizer (ChatML, as SmolLM2's) trained on the task's
    text, so a calculator run on it plays real calls through the real tool; other prompts
    get the same call, and the answer to the wrong question."""
    from dorarl.tasks.calculator import (
        CALCULATOR_TOOL,
        DEMONSTRATION,
        SYSTEM_PROMPT,
        CalculatorTask,
        calculate,
        first_messages,
    )
    from dorarl.tasks.conversation import Conversation
    from dorarl.tasks.tool_calls import Tools, default_instructions

    texts = [SYSTEM_PROMPT, default_instructions(Tools.of([CALCULATOR_TOOL]))]
    texts += [m["content"] for m in DEMONSTRATION] + ["What is 123 plus 456? The answer is 579."]
    built = build_bpe_chat_tokenizer(texts * 4, vocab_size=500)
    built.save_pretrained(str(folder))
    end = built.convert_tokens_to_ids(IM_END)
    config = Qwen2Config(
        vocab_size=len(built), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        eos_token_id=end, pad_token_id=built.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    config.save_pretrained(str(folder))
    # The tokenizer as runs load it: beside a qwen2 config.json transformers picks Qwen2's
    # class, which splits text otherwise than the tokenizer built here.
    task = CalculatorTask(folder, max_new_tokens=64, max_model_len=2048)
    tokenizer = task.tokenizer
    prompt = task.train_prompts()[0]
    a, b = (int(w.strip("?.")) for w in prompt.text.split() if w.strip("?.").isdigit())
    expression = next(
        e for e in (f"{a} + {b}", f"{a} - {b}", f"{b} - {a}", f"{a} * {b}")
        if calculate(e) == prompt.answer
    )  # fmt: skip
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    conversation = Conversation(tokenizer, [CALCULATOR_TOOL], stop_token_ids=[end])
    first = conversation.start(first_messages(prompt.text, SYSTEM_PROMPT))
    reply = encode(f"<tool_call>{call}</tool_call>") + [end]
    conversation.add_reply(reply, "stop")
    result = {"role": "tool", "content": prompt.answer, "tool_call_id": "call_0", "name": "calculator"}  # fmt: skip
    shown = conversation.render_delta([result])
    answer = encode(f"The answer is {prompt.answer}.") + [end]
    sequence = first + reply + shown + answer
    learnt = [False] * len(first) + [True] * len(reply) + [False] * len(shown) + [True] * len(answer)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _learn_by_heart(model, sequence, learnt)
    model.save_pretrained(folder)
    return folder


def _learn_by_heart(model: torch.nn.Module, sequence: list[int], learnt: list[bool]) -> None:
    """Adam on one sequence, the loss on the `learnt` tokens, until the model repeats them."""
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    inputs = torch.tensor([sequence])
    labels = torch.tensor([[t if k else -100 for t, k in zip(sequence, learnt, strict=True)]])
    for _ in range(300):
        loss = model(inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            return
    raise AssertionError(f"the tiny model did not learn its episode (loss {loss.item():.4f})")


def save_mistral_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random Mistral (heads of 32, so vLLM-CPU runs it): a family our engine does
    not run, for engine.backend=vllm."""
    from transformers import MistralConfig, MistralForCausalLM

    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(str(folder))
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        sliding_window=None, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    MistralForCausalLM(config).save_pretrained(folder)
    return folder
