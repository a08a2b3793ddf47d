"""Rewards read only the answer after a response's reasoning: the delimiters a tokenizer
declares, through the task's reward, the evaluator's accuracy and a chat env's reply."""

import json
from types import SimpleNamespace

import pytest
from chat_fixtures import chat_tokenizer, ids

from dorarl.tasks import make_task, score
from dorarl.tasks.calculator import final_answer_reward
from dorarl.tasks.conversation import Conversation
from dorarl.tasks.evaluate import evaluate
from dorarl.tasks.reasoning import Reasoning, declared_tags, reasoning_of

# (response, reward against the reference 42)
CASES = [
    ("<think>so the answer is 42</think>I am not sure.", 0.0),  # the answer is in the thought
    ("<think>Let me see: 40 + 2 = 42", 0.0),  # cut off while reasoning
    ("<think>maybe \\boxed{41}</think>The answer is 42.", 1.0),  # a box inside loses
    ("The answer is 42.", 1.0),  # no reasoning: as before
]


def test_the_answer_is_the_text_after_the_last_closed_block():
    think = Reasoning()
    assert think.answer("<think>a</think>b<think>c</think>d") == "d"
    assert think.answer("<think>a</think>b<think>c") is None  # opened again, never closed
    assert think.answer("no reasoning 42") == "no reasoning 42"
    assert think.answer("it is 42") == "it is 42"
    # A template whose generation prompt opens the block: the response starts inside it.
    assert think.answer("still thinking 42", opened=True) is None
    assert think.answer("so 42</think>It is 42.", opened=True) == "It is 42."
    assert think.leaves_open("<|im_start|>assistant\n<think>\n")
    assert not think.leaves_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_delimiters_are_those_a_tokenizer_declares():
    assert reasoning_of(chat_tokenizer("qwen3")).tags == (("<think>", "</think>"),)
    texts = ["{{ '[THINK]' + m + '[/THINK]' }}", "<|begin_of_thought|>", "<|end_of_thought|>"]
    tags = declared_tags([*texts, "<tool_call>", "</tool_call>", "<|im_end|>"])
    assert tags == (
        ("<think>", "</think>"),
        ("<|begin_of_thought|>", "<|end_of_thought|>"),
        ("[THINK]", "[/THINK]"),
    )
    assert Reasoning(tags).answer("[THINK]the answer is 42[/THINK]I am not sure.") == "I am not sure."  # fmt: skip


@pytest.fixture
def qwen3_task(tmp_path):
    rows = [json.dumps({"prompt": "What is 40 plus 2?", "answer": "42"})]
    (tmp_path / "q.jsonl").write_text("\n".join(rows) + "\n")
    return make_task(
        "jsonl", path=tmp_path / "q.jsonl", tokenizer=chat_tokenizer("qwen3"), reward="math",
        eval_fraction=0.0, max_model_len=1024, chat_template=True,
    )  # fmt: skip


def _response(task, text: str) -> list[int]:
    return ids(task.tokenizer, text) + list(task.stop_token_ids[:1])


@pytest.mark.parametrize(("text", "reward"), CASES)
def test_a_tasks_reward_reads_only_the_answer_after_the_reasoning(qwen3_task, text, reward):
    [prompt] = qwen3_task.train_prompts()
    assert score(qwen3_task, prompt, _response(qwen3_task, text)) == (reward, None)


def test_a_response_without_reasoning_is_read_as_before(qwen3_task):
    [prompt] = qwen3_task.train_prompts()
    response = _response(qwen3_task, "The answer is 42.")
    assert qwen3_task.answer_text(response, prompt) == qwen3_task.response_text(response)


def test_a_block_the_prompt_opens_is_closed_by_the_response_or_scores_0(qwen3_task):
    [prompt] = qwen3_task.train_prompts()
    opened = type(prompt)(prompt.prompt_id, prompt.text, [*prompt.prompt_ids, *ids(qwen3_task.tokenizer, "<think>\n")], prompt.answer)  # fmt: skip
    assert score(qwen3_task, opened, _response(qwen3_task, "the answer is 42"))[0] == 0.0
    assert score(qwen3_task, opened, _response(qwen3_task, "so 42</think>It is 42."))[0] == 1.0


class _Replaying:
    """An engine that answers each request with the next of `texts`, in order."""

    def __init__(self, tokenizer, texts: list[str], stop: int) -> None:
        self.tokenizer, self.texts, self.stop, self.pending = tokenizer, list(texts), stop, []

    def add_request(self, request_id, prompt_ids, params) -> None:
        self.pending.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self):
        done, self.pending = self.pending, []
        return [
            SimpleNamespace(
                request_id=r, output_ids=ids(self.tokenizer, self.texts.pop(0)) + [self.stop]
            )  # fmt: skip
            for r in done
        ]


@pytest.mark.parametrize(("text", "reward"), CASES)
def test_the_evaluators_accuracy_reads_only_the_answer(qwen3_task, text, reward):
    engine = _Replaying(qwen3_task.tokenizer, [text], qwen3_task.stop_token_ids[0])
    assert evaluate(engine, qwen3_task, qwen3_task.train_prompts())["accuracy"] == reward


@pytest.mark.parametrize(("text", "reward"), CASES)
def test_a_chat_envs_reply_is_judged_on_its_answer(text, reward):
    tok = chat_tokenizer("qwen3")
    conv = Conversation(tok, stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    conv.start([{"role": "user", "content": "What is 40 plus 2?"}])
    reply = conv.add_reply(ids(tok, text), "length" if "</think>" not in text else "stop")
    assert final_answer_reward(reply, "42") == reward
