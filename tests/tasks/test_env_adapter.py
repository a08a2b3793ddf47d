"""The documented adapter of a gymnasium-style text environment plays as an `Env` episode."""

import asyncio
import json
import re
from pathlib import Path

from dorarl.tasks.env_task import EnvTask
from dorarl.tasks.episodes import EpisodeState, reset, step
from dorarl.tasks.jsonl import JsonlTask


def test_the_documented_gymnasium_adapter_plays_as_written(tmp_path, tiny_model_dir):
    page = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "GymAdapter" in b)
    scope: dict = {}
    exec(compile(code, "docs/environments.md", "exec"), scope)
    (tmp_path / "guess.jsonl").write_text(json.dumps({"prompt": "guess:", "answer": "7"}) + "\n")
    base = JsonlTask(tmp_path / "guess.jsonl", tokenizer=tiny_model_dir, max_new_tokens=8)
    task = EnvTask(base, scope["GymAdapter"], max_turns=4, timeout_s=5.0)

    async def play(guesses):
        state = EpisodeState(task.train_prompts()[0], task.make_env())
        shown = [await reset(task, state)]
        for guess in guesses:
            ids = task.tokenizer(guess, add_special_tokens=False)["input_ids"]
            shown.append(await step(task, state, ids + task.stop_token_ids[:1], "stop"))
        return state, [task.tokenizer.decode(s) for s in shown if s]

    state, shown = asyncio.run(play(["5", "7"]))
    assert shown[0].endswith("Guess the number (1-9).") and shown[1] == "Higher."
    assert (state.reward, state.end_reason, len(state.turns)) == (1.0, "env", 2)
