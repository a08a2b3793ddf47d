"""Stop strings: a turn ends at the first token whose decoded text completes one, read
incrementally (byte-level BPE, multi-byte characters, a request moved mid-turn), and a turn
knows which ended it."""

import functools
import pickle

import pytest
from engine_testlib import make_engine, run_all, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import build_bpe_chat_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.engine.stop_strings import StopText
from dorarl.errors import UserInputError

CORPUS = ['<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'] * 20 + [
    "the price is 5 € or 7 £, naïve café; déjà vu",
    "plain words and more words, numbers 12 345",
]


@functools.cache
def tokenizer(kind: str = "byte_bpe") -> PreTrainedTokenizerFast:
    """Byte-level BPE (Qwen's and Llama 3's kind), or a sentencepiece-style one whose
    decoder drops the word-start mark of a text's first token (Llama 2's, Mistral's)."""
    if kind == "byte_bpe":
        return build_bpe_chat_tokenizer(CORPUS, vocab_size=320)
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    alphabet = sorted(set("".join(CORPUS)))
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>"], initial_alphabet=alphabet
    )
    core.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


def decode(ids: list[int], kind: str = "byte_bpe") -> str:
    tok = tokenizer(kind)
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def ids_of(text: str, kind: str = "byte_bpe") -> list[int]:
    return tokenizer(kind)(text, add_special_tokens=False)["input_ids"]


@functools.cache
def model():
    import torch

    torch.manual_seed(3)
    return Qwen2ForCausalLM(tiny_config("qwen2", vocab_size=len(tokenizer()))).eval()


def engine(**cfg) -> Engine:
    made = make_engine(model(), attention="torch", **cfg)  # the reading is the same on any path
    made.decode = decode
    return made


def first_hit(
    before: list[int], turn: list[int], stops: list[str], kind: str = "byte_bpe"
) -> int | None:
    """The index of the first turn token whose text completes a stop string, by decoding
    the whole turn again at every token (what the incremental reading must agree with)."""
    base = decode(before, kind)
    for i in range(len(turn)):
        text = decode(before + turn[: i + 1], kind)[len(base) :]
        if "\ufffd" not in text[-1:] and any(s in text for s in stops):
            return i
    return None


@pytest.mark.parametrize("kind", ["byte_bpe", "metaspace"])
@settings(max_examples=60, deadline=None)
@given(
    before=st.text(alphabet="ab <>/_€é", max_size=8),
    turn=st.text(alphabet="ab <>/_€élcto", min_size=1, max_size=40),
    start=st.integers(0, 39),
    size=st.integers(1, 6),
)
def test_the_first_token_that_completes_a_stop_string_is_found(kind, before, turn, start, size):
    stop = turn[start : start + size] or turn[:size]
    b, t = ids_of(before, kind), ids_of(turn, kind)
    text = StopText.open([stop, "never here"], functools.partial(decode, kind=kind), b)
    hits = [i for i, token in enumerate(t) if text.feed(token) is not None]
    want = first_hit(b, t, [stop, "never here"], kind)
    assert (hits[0] if hits else None) == want


def test_text_before_the_turn_is_context_not_a_match():
    text = StopText.open(["</tool_call>"], decode, ids_of("a </tool"))
    assert all(text.feed(t) is None for t in ids_of("_call> and on"))
    assert first_hit(ids_of("a </tool"), ids_of("_call> and on"), ["</tool_call>"]) is None


def test_a_multibyte_character_is_matched_once_whole():
    t = ids_of("5 €")
    assert len(t) > len("5 €")  # the euro sign spans several byte tokens
    text = StopText.open(["€"], decode, [])
    hits = [text.feed(token) for token in t]
    assert hits[-1] == "€" and hits[:-1] == [None] * (len(t) - 1)


def _free_text(n: int = 40) -> list[int]:
    e = engine()
    e.add_request(
        "free", [5, 9, 17], SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[])
    )
    return run_all(e)["free"].output_ids


def _stop_spanning_tokens(out: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one sampled token and the start of the next, and
    the index of the token that completes it."""
    for i in range(3, len(out) - 1):
        a, b = decode(out[i : i + 1]), decode(out[i + 1 : i + 2])
        if a and b and "\ufffd" not in a + b:
            stop = a[-1] + b[:2]
            if first_hit([5, 9, 17], out, [stop]) == i + 1:
                return stop, i + 1
    raise AssertionError("no stop string spans two tokens")


def test_the_engine_ends_a_request_on_a_stop_string_spanning_tokens():
    out = _free_text()
    stop, at = _stop_spanning_tokens(out)
    e = engine()
    params = SamplingParams(
        temperature=0.0, max_new_tokens=40, stop_token_ids=[], stop_strings=[stop]
    )
    e.add_request("x", [5, 9, 17], params)
    got = run_all(e)["x"]
    assert got.finish_reason == "stop_string" and got.stop_string == stop
    assert got.output_ids == out[: at + 1]
    capped = SamplingParams(
        temperature=0.0, max_new_tokens=at + 1, stop_token_ids=[], stop_strings=[stop]
    )
    e.add_request("y", [5, 9, 17], capped)  # the string completes at the cap: it wins
    assert run_all(e)["y"].finish_reason == "stop_string"
    forced = SamplingParams(
        temperature=0.0, stop_token_ids=[], stop_strings=[stop], target_len=at + 5
    )
    e.add_request("z", [5, 9, 17], forced)
    assert run_all(e)["z"].finish_reason == "length"


def test_a_turn_moved_mid_way_finds_its_stop_string_where_it_would_have():
    out = _free_text()
    stop, at = _stop_spanning_tokens(out)
    params = SamplingParams(
        temperature=0.0, max_new_tokens=40, stop_token_ids=[], stop_strings=[stop], multi_turn=True
    )
    src, dst = engine(), engine()
    src.add_request("x", [5, 9, 17], params)
    while src.progress("x") < at:  # the stop string's first half is sampled here
        src.step()
    dst.import_request(pickle.loads(pickle.dumps(src.export_request("x"))))
    ended = next(o for _ in range(100) for o in dst.step() if o.request_id == "x")
    assert ended.waits_env and ended.finish_reason == "stop_string"
    assert ended.output_ids == out[: at + 1]
    assert dst.continue_request("x", ids_of(stop))  # the next turn starts afresh
    turn = next(o for _ in range(100) for o in dst.step() if o.request_id == "x")
    ends_on_it = turn.finish_reason == "stop_string"
    before = [5, 9, 17] + turn.output_ids[: turn.turn_start]
    assert first_hit(before, turn.turn_ids, [stop]) == (
        len(turn.turn_ids) - 1 if ends_on_it else None
    )


def test_stop_strings_without_a_tokenizer_are_refused_in_one_line():
    e = make_engine(model(), attention="torch")
    with pytest.raises(UserInputError, match="stop_strings needs the model's tokenizer"):
        e.add_request("x", [1, 2], SamplingParams(stop_strings=["</tool_call>"]))
    with pytest.raises(UserInputError, match="stop_strings must be a list of non-empty"):
        engine().add_request("x", [1, 2], SamplingParams(stop_strings=[""]))


def test_an_engine_from_a_model_folder_reads_its_own_tokenizer(tmp_path):
    tokenizer().save_pretrained(str(tmp_path))
    model().save_pretrained(tmp_path)
    config = EngineConfig(max_model_len=64, num_blocks=16, attention="torch")
    e = Engine.from_pretrained(tmp_path, config)
    assert e.decode is not None and e.decode(ids_of("café")) == "café"
