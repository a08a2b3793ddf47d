"""A reward of the user's own, end to end: `dorarl train` on a JSONL task scored by a
module of the working directory; its named parts in metrics.jsonl and the trajectory
rows, and the evaluator (a Ray worker) scoring with it too."""

import json
import textwrap

import pytest

from dorarl.cli import main as cli_main
from dorarl.jobs.evaluation import with_evaluations

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

SMALL = ["instances=2", "tbs=2", "rbs=4", "group_size=2", "engine.max_num_seqs=4",
         "sampling.max_new_tokens=8", "eval.max_prompts=4", "eval.every=0", "progress=false"]  # fmt: skip


def test_a_users_dict_reward_trains_a_jsonl_task_and_its_parts_reach_the_records(
    tmp_path, monkeypatch, tiny_model_dir
):
    monkeypatch.chdir(tmp_path)  # the user's folder: the module is found here
    (tmp_path / "e2e_reward_mod.py").write_text(textwrap.dedent("""
        async def shaped(row, response, response_ids):
            return {"brevity": 1.0 / (1 + len(response_ids)),
                    "hit": float(row["answer"] in response), "weight_of_row": row["w"]}
    """))  # fmt: skip
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "w": 0.5} for i in range(20)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = [f"model={tiny_model_dir}", "task.name=jsonl", f"task.path={data}", "steps=2",
            "task.rewards=e2e_reward_mod:shaped*2,exact", "record.text=true", *SMALL]  # fmt: skip
    assert cli_main(["train", *args, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["reward_errors"] == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    for line in metrics:
        assert set(line["reward_parts"]) == {"brevity", "hit", "weight_of_row", "exact"}
        assert line["reward_parts"]["weight_of_row"] == 0.5
        assert line["reward_mean"] >= 1.0  # 2 x (0.5 + a positive brevity) at least
    rows_out = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    assert rows_out and all(set(r["reward_parts"]) >= {"hit", "exact"} for r in rows_out)
    # the evaluator's accuracy is the mean reward of the same functions (over 1: not `exact`)
    evaluated = with_evaluations(out)
    assert evaluated[0]["eval_accuracy"] >= 1.0 and evaluated[-1]["eval_accuracy"] >= 1.0
