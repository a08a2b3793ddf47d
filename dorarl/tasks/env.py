"""The multi-turn environment interfaces, and how a user's class is found (`module:Class`).

An environment speaks text (`Env`) or messages (`ChatEnv`). An `Env` serves one episode: `reset(prompt)` gives the first observation (the text the
model sees after the task's prompt), then each `step(response)` judges one turn's response
and answers the next observation, a reward and whether the episode is done. Both are
coroutines, so an environment may wait on tools or services without blocking a thread;
the runtime bounds every call by a timeout and an episode by a turn cap. The episode's
reward is the sum of its steps' rewards. A `ChatEnv` speaks messages instead: `reset`
gives the first messages, each reply's tool calls (parsed in the model's own format from
its `tools`) are served by `call_tool`, and `step(reply, results)` answers the messages
that follow the results; dorarl renders them with the model's chat template
(dorarl/tasks/conversation.py). Invariant: an environment sees only text or messages;
token ids, versions and KV are the runtime's business.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from dorarl.errors import UserInputError

if TYPE_CHECKING:
    from dorarl.tasks.base import Prompt
    from dorarl.tasks.conversation import Message, Reply
    from dorarl.tasks.tool_calls import ToolCall


@dataclass(frozen=True)
class EnvStep:
    """What an environment answers to one turn."""

    observation: str
    reward: float  # a finite number: anything else ends the episode as the env's failure
    done: bool


class Env(ABC):
    """One episode's environment; a new instance per episode."""

    @abstractmethod
    async def reset(self, prompt: Prompt) -> str:
        """The first observation, appended to the prompt before the first turn."""

    @abstractmethod
    async def step(self, response: str) -> EnvStep:
        """Judge a turn's response (decoded up to its stop token)."""


class ToolError(Exception):
    """Raised by `ChatEnv.call_tool` for a call it cannot serve as asked (bad arguments, a
    failed lookup); the model is told `error: <message>` and the episode goes on. Any other
    exception ends the episode, as an environment's failure."""


@dataclass(frozen=True)
class ChatStep:
    """What a chat environment answers to one reply: the messages after its tool results
    (e.g. a user's), the reward, and whether the episode is done."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False


class ChatEnv(ABC):
    """One episode's environment, in messages; a new instance per episode.

    `tools` (JSON schemas, OpenAI's function form) are offered through the chat template;
    `stop_strings` end a turn early (e.g. `("</tool_call>",)`, so a call runs before more is
    sampled); `template_kwargs` go to the chat template (e.g. `{"enable_thinking": False}`)."""

    tools: ClassVar[list[dict[str, Any]]] = []
    stop_strings: ClassVar[tuple[str, ...]] = ()
    template_kwargs: ClassVar[dict[str, Any]] = {}

    @abstractmethod
    async def reset(self, prompt: Prompt) -> list[Message]:
        """The first messages (system, user), rendered with the generation prompt."""

    async def call_tool(self, call: ToolCall) -> str:
        """Serve one well-formed call of a declared tool: its result, as the tool message's
        content (a dict or list is sent as JSON)."""
        raise ToolError(f"{call.name} is not served here")

    @abstractmethod
    async def step(self, reply: Reply, results: list[Message]) -> ChatStep:
        """Judge a reply (`reply.finish_reason` says how its turn ended: "stop", "stop_string"
        or "length"), given the tool messages that answer its calls, in order."""


def load_env_class(spec: str, key: str = "task.env") -> type[Env] | type[ChatEnv]:
    """`package.module:ClassName` -> the class, checked; one line naming `key` otherwise
    (the module is found as `import_user_module` finds it)."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise UserInputError(f"{key}: expected 'module:Class', got {spec!r}")
    module = import_user_module(module_name, key)
    cls = getattr(module, class_name, None)
    if cls is None:
        found = env_classes(module)
        listed = (
            f"its environments: {', '.join(found)}" if found else "it defines no Env or ChatEnv"
        )
        raise UserInputError(f"{key}: module {module_name!r} has no {class_name!r} ({listed})")
    if not isinstance(cls, type) or not issubclass(cls, Env | ChatEnv):
        raise UserInputError(
            f"{key}: {spec!r} is not a subclass of dorarl.tasks.env.Env or ChatEnv (reset, step)"
        )
    return cls


def env_classes(module: ModuleType) -> list[str]:
    """The names of the concrete Env and ChatEnv subclasses a module defines or imports."""
    return sorted(
        name
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, Env | ChatEnv)
        and value not in (Env, ChatEnv)
        and not inspect.isabstract(value)
    )


def import_user_module(module_name: str, key: str) -> ModuleType:
    """A user's module (an environment's, an agent's), looked up on the Python path and in
    the working directory (the `dorarl` command's own path does not hold it; Ray's workers
    get the driver's working directory on theirs); one line naming `key` otherwise."""
    _import_from_working_directory()
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        where = f"the Python path or {os.getcwd()}"
        raise UserInputError(
            f"{key}: cannot import module {module_name!r} from {where} ({exc})"
        ) from None


def _import_from_working_directory() -> None:
    """Put the working directory on the import path, after what is there (a module of the
    working directory never shadows an installed one)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
