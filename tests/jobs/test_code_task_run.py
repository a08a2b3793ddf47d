"""The code task end to end: `dorarl train task.name=code` scores each response's program in
the sandbox; the share of tests passed reaches metrics.jsonl and each trajectory row says
why its program failed first."""

import json

import pytest

from dorarl.cli import main as cli_main
from dorarl.tasks.code_reward import NO_CODE
from dorarl.tasks.sandbox import bwrap_problem

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

SANDBOX = "bwrap" if bwrap_problem() is None else "unsafe_rlimits_only"
SMALL = ["instances=1", "tbs=2", "rbs=4", "group_size=2", "engine.max_num_seqs=4",
         "sampling.max_new_tokens=8", "eval.max_prompts=2", "eval.every=0", "progress=false"]  # fmt: skip


def test_a_code_run_scores_programs_in_the_sandbox_and_records_the_first_failure(
    tmp_path, tiny_model_dir
):
    rows = [
        {"prompt": f"print {i}", "tests": [{"stdin": "", "stdout": f"{i}\n"}]} for i in range(8)
    ]
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = [f"model={tiny_model_dir}", "task.name=code", f"task.path={data}", "steps=2",
            f"task.sandbox={SANDBOX}", "record.text=true", *SMALL]  # fmt: skip
    assert cli_main(["train", *args, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["reward_errors"] == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert all(line["reward_parts"] == {"tests_passed": 0.0} for line in metrics)
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    assert trajectories
    assert all(r["reward_info"] == {"first_failure": NO_CODE} for r in trajectories)
