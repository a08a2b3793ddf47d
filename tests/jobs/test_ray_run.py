"""A run on Ray from `dorarl train`: one started in a process that has already joined Ray
uses that Ray, keeps it, and leaves none of its actors running in it."""

from __future__ import annotations

import re
import time

import pytest


@pytest.mark.slow
def test_a_run_uses_the_ray_its_process_joined_and_leaves_no_actor_in_it(
    tmp_path, tiny_model_dir, shared_ray, fresh_actors, capsys
):
    """A notebook's or a script's own Ray is kept, and nothing of the run is left running in
    it: its engines, trainer and evaluator are stopped at the end."""
    from ray._private import state

    from dorarl.jobs.train import main as train_main

    def alive() -> set[str]:
        return {a for a, info in state.actors().items() if info["State"] != "DEAD"}

    before = alive()
    small = ["instances=2", "tbs=2", "rbs=4", "group_size=2", "engine.max_num_seqs=4",
             "eval.max_prompts=4", "progress=false", "steps=2"]  # fmt: skip
    assert train_main([f"model={tiny_model_dir}", *small, "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Ray up in \d+\.\ds \(the Ray this process had joined\)", out)
    assert shared_ray.is_initialized()
    deadline = time.monotonic() + 10  # the cluster marks a killed actor dead shortly after
    while alive() != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive() == before
