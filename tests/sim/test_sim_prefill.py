"""The cost model's prefill: per group with the prefix cache, per sample without it."""

import json

from dorarl.controller import ControllerConfig
from dorarl.data.lengths import LengthDist
from dorarl.sim import CostModel, SimRuntime

PROMPT = 512
LENGTHS = LengthDist(median=64, p99_ratio=4, group_corr=0.5, max_len=512, prompt_len=PROMPT)


def test_requests_of_one_prompt_prefill_it_once_with_the_cache():
    cost = CostModel()
    assert cost.prefill_tokens(PROMPT, [PROMPT] * 8) == PROMPT + 7  # the others: last token
    assert cost.prefill_tokens(PROMPT, [PROMPT + 30, PROMPT + 2]) == PROMPT + 30 + 2
    assert cost.prefill_tokens(PROMPT, [PROMPT] * 3, cached=True) == 3  # a later dispatch
    off = CostModel(prefix_cache=False)
    assert off.prefill_tokens(PROMPT, [PROMPT] * 8) == 8 * PROMPT


def _run(mode: str, tmp_path, prefix_cache: bool) -> tuple[dict, list[dict]]:
    config = ControllerConfig(mode=mode, K=1, rbs=16, tbs=16, group_size=8, instances=2,
                              slots=64, steps=4)  # fmt: skip
    cost = CostModel(prefix_cache=prefix_cache, prefill_per_token_s=2e-4)
    out = tmp_path / f"{mode}-{prefix_cache}"
    summary = SimRuntime(config, cost, LENGTHS, seed=3, out_dir=out).run().summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_the_saving_shows_in_the_rollout_time_and_the_step_rows(tmp_path):
    on, rows = _run("sync", tmp_path, True)
    off, _ = _run("sync", tmp_path, False)
    groups = on["dispatched"]
    assert off["prefill_tokens"] == groups * 8 * PROMPT
    # each group's prompt once per instance it lands on (at most 2), one token per sample
    assert groups * (PROMPT + 7) <= on["prefill_tokens"] <= groups * 2 * (PROMPT + 7)
    assert on["prefill_saved_tokens"] == off["prefill_tokens"] - on["prefill_tokens"]
    assert on["prefix_hit_rate"] > 0.85 and off["prefix_hit_rate"] == 0.0
    assert on["rollout_only_share"] < off["rollout_only_share"]
    assert sum(r["prefill_tokens"] for r in rows) == on["prefill_tokens"]


def test_a_resumed_group_prefills_its_prompt_once(tmp_path):
    on, _ = _run("partial_rollout", tmp_path, True)
    off, _ = _run("partial_rollout", tmp_path, False)
    assert on["reprefill_tokens"] > 0 and on["dispatched"] == off["dispatched"]
    at_dispatch = on["dispatched"] * 7 * (PROMPT - 1)  # what fresh groups save
    assert off["prefill_tokens"] - on["prefill_tokens"] > at_dispatch  # resumes save too
