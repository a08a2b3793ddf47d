"""`dorarl train resume=`: continue a run from a checkpoint, its version and data position;
a run whose worker failed says so on one line and how to resume."""

import json

import pytest
from transformers import AutoTokenizer

from dorarl.cli import main as cli_main
from dorarl.config import ConfigError, load_config
from dorarl.errors import RunFailed, WorkerFailed
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.ray_run import failure_report
from dorarl.jobs.resume import find_checkpoint, read_resume_point
from dorarl.jobs.train import main as train_main
from dorarl.jobs.train import resume_point
from dorarl.tasks import make_task


def _fake_checkpoint(folder, version, **extra):
    folder.mkdir(parents=True)
    state = {"version": version, "extra_state": {"version": version, **extra}}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def test_a_run_folder_resumes_from_its_newest_checkpoint(tmp_path):
    for v in (2, 10, 4):
        _fake_checkpoint(tmp_path / "checkpoints" / f"version_{v:05d}", v)
    _fake_checkpoint(tmp_path / "checkpoints" / "version_00011.tmp", 11)  # an unfinished rewrite
    assert find_checkpoint(tmp_path).name == "version_00010"
    point = read_resume_point(_fake_checkpoint(tmp_path / "one", 7, first_group=40,
                                               first_prompt=41, resume_prompts=[3, 9]))  # fmt: skip
    assert (point.version, point.first_group, point.first_prompt) == (7, 40, 41)
    assert point.controller_keys()["resume_prompts"] == [3, 9]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [([], "resume: "), (["runtime=sim"], "resume: only runtime=ray")],
)  # fmt: skip
def test_bad_resume_settings_exit_2_with_one_line(tmp_path, capsys, extra, needle):
    ckpt = _fake_checkpoint(tmp_path / "ckpt", 3) if extra else tmp_path / "nothing"
    rc = cli_main(["train", f"resume={ckpt}", "progress=false", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_resuming_a_complete_run_says_so_and_exits_0(tmp_path, capsys):
    # what a stop or abort that lands after the last step leaves: nothing is wrong
    ckpt = _fake_checkpoint(tmp_path / "ckpt", 3)
    assert cli_main(["train", f"resume={ckpt}", "progress=false", "steps=3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "nothing to do" in out[0] and "steps=N (N > 3)" in out[0], out


def test_a_data_position_of_another_version_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    state = {"version": 5, "extra_state": {"version": 4}}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="resume: .* version 5 .* version 4"):
        resume_point(load_config(TrainConfig, overrides=[f"resume={folder}"]))


SMALL = ["instances=1", "tbs=2", "rbs=4", "group_size=2", "engine.max_num_seqs=4",
         "eval.max_prompts=4", "eval.every=0", "progress=false", "mode=dora", "K=1"]  # fmt: skip


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_resume_continues_version_steps_and_untrained_prompts(tmp_path, tiny_model_dir):
    first = tmp_path / "first"
    args = [f"model={tiny_model_dir}", *SMALL]
    run = [*args, "steps=3", "checkpoint_every=1", "checkpoint_keep=3", "--out", str(first)]
    assert train_main(run) == 0
    kept = sorted(p.name for p in (first / "checkpoints").iterdir())
    assert kept == ["version_00001", "version_00002", "version_00003"]
    before = json.loads((first / "summary.json").read_text())
    # v1: the first rbs groups went out at the start and step 0 trained tbs of them, so its
    # position holds untrained prompts whatever the timing (a later one may hold none: its
    # groups can all be trained before the engines load the version new groups go to)
    middle = first / "checkpoints" / "version_00001"
    saved = json.loads((middle / "trainer_state.json").read_text())
    assert saved["version"] == 1 and saved["extra_state"]["version"] == 1
    position = saved["extra_state"]
    assert len(position["resume_prompts"]) >= 2

    # from the middle checkpoint into a new folder: steps 1..2, the untrained prompts first
    # (no evaluator: what this segment shows is its training)
    second = tmp_path / "second"
    into_second = [f"resume={middle}", "steps=3", "eval.every=off", "--out", str(second)]
    assert train_main([*args, *into_second]) == 0
    metrics = _lines(second / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and metrics[0]["version"] == 1
    state = json.loads(
        (second / "checkpoints" / "version_00003" / "trainer_state.json").read_text()
    )
    assert state["version"] == 3 and state["optimizer_steps"] == 3
    task = make_task("running_sum", seed=0, tokenizer=AutoTokenizer.from_pretrained(middle))
    prompts = task.train_prompts()
    by_group = {t["group_id"]: t["prompt_id"] for t in _lines(second / "trajectories.jsonl")}
    replayed = [by_group.get(position["first_group"] + i) for i in range(2)]
    expected = [prompts[p % len(prompts)].prompt_id for p in position["resume_prompts"][:2]]
    assert replayed == expected  # K=1: groups of v1 are all consumed by step 2, in this run
    assert all(t["behavior_version"] >= 1 for t in _lines(second / "trajectories.jsonl"))

    # from the run folder itself (its newest checkpoint, v3), into it: metrics continue, and
    # keeping two checkpoints prunes the older ones
    resumed = [f"resume={first}", "steps=4", "checkpoint_keep=2", "--out", str(first)]
    history = {name: (first / name).read_bytes() for name in ("metrics.jsonl", "evaluations.jsonl")}
    assert train_main([*args, *resumed]) == 0
    for name, earlier in history.items():  # appended to, never rewritten
        assert (first / name).read_bytes().startswith(earlier), name
    metrics = _lines(first / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    kept = sorted(p.name for p in (first / "checkpoints").iterdir())
    assert kept == ["version_00003", "version_00004"]
    # its summary and trace are the whole run's: both segments, every step once
    summary = json.loads((first / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["dropped_total"] == 0
    assert {"0", "3", "4"} <= set(summary["eval"])  # from evaluations.jsonl, by version
    assert summary["consumed_tokens"] == sum(m["consumed_tokens"] for m in metrics)
    segments = summary["segments"]
    assert [(s["start_version"], s["end_version"], s["ended"]) for s in segments] == [
        (0, 3, "finished"),
        (3, 4, "finished"),
    ]
    assert segments[0]["wall_time_s"] == before["wall_time_s"] < summary["wall_time_s"]
    trace = json.loads((first / "trace.json").read_text())["traceEvents"]
    steps = [e for e in trace if e["name"].startswith("train step")]
    assert [e["name"] for e in steps] == [f"train step {s} (v{s} -> v{s + 1})" for s in range(4)]
    assert steps[3]["ts"] > steps[2]["ts"] + steps[2]["dur"]  # the resume, later on one clock


def test_a_failed_worker_says_what_failed_and_how_to_resume(tmp_path):
    exc = WorkerFailed("engine instance 2 (decoding)", "\nActorDiedError: boom\n  at line 3\n")
    assert str(exc) == "engine instance 2 (decoding) failed: ActorDiedError: boom"
    assert "no checkpoint yet" in failure_report(exc, tmp_path)
    _fake_checkpoint(tmp_path / "checkpoints" / "version_00004", 4)
    line = failure_report(exc, tmp_path)
    assert f"dorarl train resume={tmp_path}" in line and "version_00004" in line
    assert "at line 3" in (tmp_path / "failure.txt").read_text()  # the whole error is kept


def test_the_cli_prints_a_failed_run_on_one_line_with_exit_1(monkeypatch, tmp_path, capsys):
    import dorarl.jobs.ray_run as ray_run

    def fail(config, point, out_dir, **kwargs):
        raise RunFailed("the trainer (training step 3) failed: OOM; resume with ...")

    monkeypatch.setattr(ray_run, "run_ray", fail)
    rc = cli_main(["train", "progress=false", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("dorarl: run failed: the trainer")
