"""scripts/config_walk.py: its counts, and a walk that follows the config into the runtime."""

from __future__ import annotations

from scripts_dir import load_script


def _walker():
    return load_script("config_walk")


def test_climbs_and_returns_are_counted_on_the_files_entered():
    walk = _walker()
    trail = [
        ("dorarl.jobs.ray_run", "run_ray"),
        ("dorarl.jobs.ray_run", "_run"),  # the same file again: one step
        ("dorarl.runtime.ray_runtime", "RayRuntime.__init__"),
        ("dorarl.record.recorder", "Recorder.__init__"),
        ("dorarl.runtime.ray_runtime", "RayRuntime.start"),  # a climb, and a return
        ("dorarl.jobs.ray_run", "_gather"),  # a climb, and a return
    ]
    figures = walk.figures(trail, {})
    assert (figures["steps"], figures["climbs"], figures["returns"]) == (4, 2, 2)


def test_the_config_reaches_the_controller_through_the_runtime():
    walk = _walker()
    found = walk.Walk(walk._index())
    found.enter(found._named("dorarl.jobs.ray_run.run_ray"), {"config": None})
    entered = {f"{module}:{name}" for module, name in found.trail}
    assert "dorarl.runtime.ray_runtime:RayRuntime.__init__" in entered
    assert "dorarl.controller.controller:Controller.__init__" in entered
    # a task is what build_task made, not the config: its methods are not followed
    assert "dorarl.runtime.episodes:Episodes.__init__" not in entered
