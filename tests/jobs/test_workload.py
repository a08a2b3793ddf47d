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
