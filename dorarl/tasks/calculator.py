"""`calculator`: multi-digit arithmetic asked in words, with a calculator tool the model may call.

"What is 347 times 28?": the model may call `calculator` (`<tool_call>{"name":
"calculator", "arguments": {"expression": "347 * 28"}}</tool_call>` in the format its
template teaches, hermes for a template without tools) as often as `max_turns` allows and
reads each result in a tool message; its first reply without a call is its final answer,
scored 1 when the strictly extracted final answer (dorarl.tasks.answers) equals the result.
A call that does not parse, names another tool or holds no arithmetic gets an error tool
message and the episode goes on. Invariants: the prompts are a pure function of (seed,
config); no held-out problem (operation and operands, in any order) is a training prompt;
the calculator evaluates arithmetic only (numbers, + - * /, parentheses), never code.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from dorarl.errors import UserInputError
from dorarl.tasks.base import Prompt, Task
from dorarl.tasks.conversation import Conversation, Message, Reply
from dorarl.tasks.env import ChatEnv, ChatStep, ToolError
from dorarl.tasks.held_out import draw_held_out, draw_training
from dorarl.tasks.model_files import context_limit, load_chat_tokenizer, stop_ids
from dorarl.tasks.reasoning import Reasoning
from dorarl.tasks.rewards import math_equivalent
from dorarl.tasks.tool_calls import CALL_STOP_STRINGS, OPEN, ToolCall

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * /, parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 347 * 28"}},
            "required": ["expression"],
        },
    },
}
SYSTEM_PROMPT = (
    "You are a calculator assistant: for every arithmetic question, call the calculator tool "
    "first, then reply: The answer is <result>."
)
# One worked exchange before the question: a 135M model imitates a dialogue far more
# readily than it follows instructions (SmolLM2-135M-Instruct calls the tool in none of 64
# greedy episodes without it, in a quarter with it).
DEMONSTRATION: list[dict[str, str]] = [
    {"role": "user", "content": "What is 214 times 37?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "214 * 37"}}'
        "</tool_call>",
    },
    {"role": "tool", "content": "7918", "name": "calculator", "tool_call_id": "call_example"},
    {"role": "assistant", "content": "The answer is 7918."},
]
PHRASINGS = {
    "+": ("What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?"),
    "-": ("What is {a} minus {b}?", "Subtract {b} from {a}.", "Take {b} away from {a}."),
    "*": ("What is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?"),
}
OPERATIONS = {"add": "+", "subtract": "-", "multiply": "*"}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**18  # a calculator's display: larger intermediate values are refused
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
# What models write for the operators beside Python's.
_SPELLINGS = {"×": "*", "÷": "/", "−": "-", "x": "*", "X": "*"}


@dataclass(frozen=True)
class CalculatorConfig:
    """Operands are drawn uniformly from min_value..max_value (the second of a product from
    min_factor..max_factor, so products stay a few digits long); `ops` picks the operations;
    a difference is the larger minus the smaller. The held-out set takes n_eval distinct
    problems, or a quarter of those the ranges allow when that is fewer."""

    min_value: int = 100
    max_value: int = 999
    min_factor: int = 11
    max_factor: int = 99
    ops: tuple[str, ...] = ("add", "subtract", "multiply")
    n_train: int = 10000
    n_eval: int = 500
    system_prompt: str | None = None  # None: SYSTEM_PROMPT
    demonstration: bool = True  # the worked exchange before the question
    max_turns: int = 4  # replies per episode at most, calls and the final answer

    def __post_init__(self) -> None:
        if not 0 <= self.min_value < self.max_value:
            raise ValueError(
                f"min_value, max_value: need 0 <= min_value < max_value, got "
                f"{self.min_value}..{self.max_value}"
            )
        if not 0 <= self.min_factor < self.max_factor:
            raise ValueError(
                f"min_factor, max_factor: need 0 <= min_factor < max_factor, got "
                f"{self.min_factor}..{self.max_factor}"
            )
        if not self.ops or not set(self.ops) <= set(OPERATIONS):
            raise ValueError(
                f"ops: a non-empty list of {', '.join(OPERATIONS)}, got {list(self.ops)}"
            )
        if self.n_train < 1 or self.n_eval < 1:
            raise ValueError(f"n_train, n_eval: must be >= 1, got {self.n_train}, {self.n_eval}")
        if self.max_turns < 2:
            raise ValueError(f"max_turns: a call and its answer need 2 turns, got {self.max_turns}")


@dataclass(frozen=True)
class Problem:
    op: str  # "+", "-" or "*"
    a: int
    b: int

    @property
    def result(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    def key(self) -> tuple[str, int, int]:
        """The same question whatever the order of a sum's or a product's operands."""
        if self.op == "-":
            return ("-", self.a, self.b)
        return (self.op, min(self.a, self.b), max(self.a, self.b))


def draw_problem(rng: random.Random, cfg: CalculatorConfig) -> Problem:
    """A uniform problem of one of `cfg.ops` whose result is none of its operands."""
    while True:
        op = OPERATIONS[rng.choice(cfg.ops)]
        a = rng.randint(cfg.min_value, cfg.max_value)
        if op == "*":
            b = rng.randint(cfg.min_factor, cfg.max_factor)
        else:
            b = rng.randint(cfg.min_value, cfg.max_value)
        if op == "-" and a < b:
            a, b = b, a
        problem = Problem(op, a, b)
        if problem.result not in (a, b):
            return problem


def question(problem: Problem, rng: random.Random) -> str:
    return rng.choice(PHRASINGS[problem.op]).format(a=problem.a, b=problem.b)


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as a calculator shows it (an integer, else a
    decimal of up to 6 places); ToolError saying what is wrong otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    text = _normalised(expression)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot read {expression!r} as arithmetic (numbers, + - * /, parentheses)") from None  # fmt: skip
    value = _value(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0")


def _normalised(expression: str) -> str:
    """Thousands separators dropped, the usual operator signs read as Python's, a trailing
    `=` dropped."""
    text = expression.strip().rstrip("=").strip()
    for sign, python in _SPELLINGS.items():
        text = text.replace(sign, python)
    out = []
    for i, ch in enumerate(text):  # "1,234" -> "1234"; a comma elsewhere stays (and fails)
        digits_around = 0 < i < len(text) - 3 and text[i - 1].isdigit()
        if ch == "," and digits_around and text[i + 1 : i + 4].isdigit():
            continue
        out.append(ch)
    return "".join(out)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolError("division by zero")
        return _bounded(_OPERATORS[type(node.op)](left, right))
    raise ToolError("only numbers, + - * / and parentheses are calculated")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError("the number is too large for the calculator")
    return value


def final_answer_reward(reply: Reply, answer: str) -> float:
    """1.0 when the reply's strictly extracted final answer (after its reasoning) equals
    `answer`; 0.0 for a reply that ends inside its reasoning."""
    return 0.0 if reply.answer is None else math_equivalent(reply.answer, answer)


class CalculatorEnv(ChatEnv):
    """One episode: the question, the calculator served, the final answer judged."""

    tools = [CALCULATOR_TOOL]
    stop_strings = CALL_STOP_STRINGS["hermes"]  # a call ends the turn: the tool runs now

    def __init__(
        self,
        system_prompt: str = SYSTEM_PROMPT,
        demonstration: bool = True,
        latency_s: float = 0.0,
    ) -> None:
        self.system_prompt, self.demonstration = system_prompt, demonstration
        self.latency_s = latency_s
        self.answer = ""

    async def reset(self, prompt: Prompt) -> list[Message]:
        self.answer = prompt.answer
        return first_messages(prompt.text, self.system_prompt, self.demonstration)

    async def call_tool(self, call: ToolCall) -> str:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)  # a remote tool's round trip (benchmarks)
        return calculate(_expression(call.arguments))

    async def step(self, reply: Reply, results: list[Message]) -> ChatStep:
        if reply.calls:  # the model reads the results next turn
            return ChatStep()
        return ChatStep(reward=final_answer_reward(reply, self.answer), done=True)


def _last_special(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Where the last added (special) token in `text` starts; 0 when none."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.content]
    return max([text.rfind(a) for a in added] + [0])


def first_messages(
    question_text: str, system_prompt: str, demonstration: bool = True
) -> list[Message]:
    """The system prompt, the worked example (when asked for), the question."""
    shown = DEMONSTRATION if demonstration else []
    return [
        {"role": "system", "content": system_prompt},
        *shown,
        {"role": "user", "content": question_text},
    ]


class CalculatorTask(Task):
    """The built-in calculator task; its prompts are built and checked on construction."""

    name = "calculator"
    multi_turn = True

    def __init__(
        self,
        tokenizer: str | Path | PreTrainedTokenizerBase | None = None,
        seed: int = 0,
        config: CalculatorConfig | None = None,
        max_new_tokens: int = 40,
        max_model_len: int | None = None,
        latency_s: float = 0.0,
        timeout_s: float = 30.0,
    ) -> None:
        self.seed, self.config = seed, config or CalculatorConfig()
        self.tokenizer, model_dir = load_chat_tokenizer(tokenizer, "calculator")
        self.stop_token_ids = stop_ids(self.tokenizer, model_dir)
        self.stop_strings = list(CalculatorEnv.stop_strings)
        self.max_new_tokens = max_new_tokens  # per turn
        self.max_turns = self.config.max_turns
        self.env_timeout_s, self.latency_s = timeout_s, latency_s
        self.max_model_len = max_model_len or context_limit(model_dir, self.tokenizer)
        self.system_prompt = self.config.system_prompt or SYSTEM_PROMPT
        eval_problems = self._draw_eval_problems()
        rng = random.Random(f"calculator/train/{seed}")
        train = draw_training(self._draw, rng, self.config.n_train, eval_problems)
        self._train = self._prompts(train, 0, rng)
        eval_rng = random.Random(f"calculator/eval-phrasing/{seed}")
        self._eval = self._prompts(eval_problems, self.config.n_train, eval_rng)
        self._check_room()

    def train_prompts(self) -> list[Prompt]:
        return self._train

    def eval_prompts(self) -> list[Prompt]:
        return self._eval

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        """A single reply read as the final answer (episodes score through the env)."""
        return math_equivalent(self.answer_text(response_ids, prompt), prompt.answer)

    def make_env(self) -> CalculatorEnv:
        return CalculatorEnv(self.system_prompt, self.config.demonstration, self.latency_s)

    def episode_prompt_ids(self, prompt: Prompt) -> list[int]:
        return list(prompt.prompt_ids)

    def _draw_eval_problems(self) -> list[Problem]:
        """Distinct problems, drawn before (and so independent of) the training set."""
        cfg = self.config
        span, factors = cfg.max_value - cfg.min_value + 1, cfg.max_factor - cfg.min_factor + 1
        sizes = {"add": span * span // 2, "subtract": span * span // 2, "multiply": span * factors}
        distinct = sum(sizes[op] for op in set(cfg.ops))
        n_eval = min(cfg.n_eval, distinct // 4)
        if n_eval < 1:
            raise UserInputError(
                f"task calculator: the ranges allow only {distinct} problems, too few to hold "
                f"some out; widen task.max_value"
            )
        return draw_held_out(self._draw, random.Random(f"calculator/eval/{self.seed}"), n_eval)

    def _draw(self, rng: random.Random) -> Problem:
        return draw_problem(rng, self.config)

    def _prompts(self, problems: list[Problem], first_id: int, rng: random.Random) -> list[Prompt]:
        texts = [question(p, rng) for p in problems]
        ids = self._first_prompt_ids(texts)
        return [
            Prompt(first_id + i, text, prompt_ids, str(p.result))
            for i, (p, text, prompt_ids) in enumerate(zip(problems, texts, ids, strict=True))
        ]

    def _first_prompt_ids(self, texts: list[str]) -> list[list[int]]:
        """Each question's first prompt as its episode renders it (system prompt, tool
        instructions, question, generation prompt). The conversation is rendered once around
        a marker; the text before the last special token ahead of the question is tokenized
        once (no merge crosses a special token) and only the rest per question, after
        checking on the first questions that this equals a full rendering."""
        marker = "QUESTIONMARKER"  # letters: any tokenizer decodes them as written
        text = self.tokenizer.decode(
            self._conversation_ids(marker),
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
        prefix, _, suffix = text.partition(marker)
        cut = _last_special(self.tokenizer, prefix)
        head, tail = self._encode(prefix[:cut]), prefix[cut:]
        rest = self.tokenizer([tail + t + suffix for t in texts], add_special_tokens=False)
        ids = [head + list(r) for r in rest["input_ids"]]
        if any(ids[i] != self._conversation_ids(t) for i, t in enumerate(texts[:4])):
            return [self._conversation_ids(t) for t in texts]
        return ids

    def _conversation_ids(self, question_text: str) -> list[int]:
        conversation = Conversation(
            self.tokenizer, CalculatorEnv.tools, stop_token_ids=self.stop_token_ids
        )
        messages = first_messages(question_text, self.system_prompt, self.config.demonstration)
        return conversation.start(messages)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_room(self) -> None:
        """The longest first prompt and max_turns replies of max_new_tokens must fit; the
        tool messages between them are bounded by the room the engine has left."""
        longest = max(len(p.prompt_ids) for p in self._train + self._eval)
        need = longest + self.max_new_tokens * 2
        if need > self.max_model_len:
            raise UserInputError(
                f"task calculator: first prompts of up to {longest} tokens and two replies of "
                f"max_new_tokens={self.max_new_tokens} exceed the context limit of "
                f"{self.max_model_len} tokens; raise engine.max_model_len"
            )


async def solve(client: Any, prompt: Prompt) -> float:
    """The same episode through the OpenAI API (`task.agent=dorarl.tasks.calculator:solve`):
    the shipped system prompt and demonstration, the calculator offered as a tool and run
    here, the first reply without a call judged. `client` is an `openai.AsyncOpenAI`."""
    messages: list[dict[str, Any]] = first_messages(prompt.text, SYSTEM_PROMPT)
    while True:  # the endpoint refuses a call past task.max_turns
        try:
            completion = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR_TOOL]
            )
        except Exception as exc:
            if getattr(exc, "code", None) == "max_turns":
                return 0.0
            raise
        message = completion.choices[0].message
        text = message.content or ""
        if not message.tool_calls and OPEN not in text:
            answer = Reasoning().answer(text)  # the client has no tokenizer: <think> blocks
            return 0.0 if answer is None else math_equivalent(answer, prompt.answer)
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:  # dorarl could not read the call: the model is told
            messages.append({"role": "tool", "tool_call_id": "call_unread", "content": UNREAD})
        for call in message.tool_calls or []:
            content = served(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})


UNREAD = (
    'error: the call is not <tool_call>{"name": "calculator", "arguments": {"expression": '
    '"..."}}</tool_call>; not run'
)


def served(arguments: str) -> str:
    """A calculator call's result from its JSON arguments; errors as the environment says them."""
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    try:
        return calculate(_expression(parsed))
    except ToolError as exc:
        return f"error: {exc}"


def _expression(arguments: Any) -> str:
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str | int | float) or isinstance(expression, bool):
        raise ToolError('the arguments are {"expression": "<arithmetic>"}')
    return str(expression)
