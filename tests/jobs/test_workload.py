"""The run's task options: each task gets the keys of its own from the run's config."""

from dorarl.config import load_config
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.workload import task_options


def test_the_code_task_gets_task_demonstration():
    on = task_options(load_config(TrainConfig, overrides=["task.name=code"]))
    off = task_options(
        load_config(TrainConfig, overrides=["task.name=code", "task.demonstration=false"])
    )
    assert on == ("code", on[1]) and on[1]["demonstration"] is True
    assert off[1]["demonstration"] is False


def test_jsonl_and_code_get_their_held_out_share_and_training_order():
    for name in ("jsonl", "code"):
        keys = [f"task.name={name}", "task.path=d.jsonl"] if name == "jsonl" else ["task.name=code"]
        default = task_options(load_config(TrainConfig, overrides=keys))[1]
        assert default["eval_fraction"] == 0.1 and default["shuffle"] is True
        keys += ["task.eval_fraction=0.25", "task.shuffle=false"]
        chosen = task_options(load_config(TrainConfig, overrides=keys))[1]
        assert chosen["eval_fraction"] == 0.25 and chosen["shuffle"] is False
