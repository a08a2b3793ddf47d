"""The run folder: which one a run writes to, and one consistent history when a run resumes.

`--out` must be a new or empty folder, or the run that `resume=` continues. config.json
holds the run's settings with its paths absolute, so a resume reads them wherever it starts.
`resume=` naming a run folder (or a checkpoint inside one) takes that run's config.json as
its config and that folder as its output, so `dorarl train resume=RUN_DIR` alone finishes
the run. Resumed into its own folder from version V, everything logged after V (metrics,
trajectory and evaluation rows, TensorBoard, newer checkpoints, the records of segments that
started at V or later) is moved to `rolled_back/`, so the files read as one history. The
folder's layout is dorarl.run_layout's.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from dorarl.config import ConfigError, load_config, to_dict
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.model_context import context_given, with_model_context
from dorarl.record.evaluations import read_evaluations
from dorarl.record.segments import roll_back_segments
from dorarl.run_layout import (
    STATE_FILE,
    RunFolder,
    checkpoint_entries,
    checkpoint_version_strict,
    run_of_checkpoint,
)


def resume_command(out_dir: Path) -> str:
    """The command that continues the run in `out_dir` (its own config and folder)."""
    return f"dorarl train resume={shlex.quote(str(out_dir))}"


def run_of(resume: str | None) -> Path | None:
    """The run folder `resume=` names: itself, or the one a checkpoint was written in."""
    if not resume:
        return None
    path = Path(resume)
    if RunFolder(path).config.is_file() and not (path / STATE_FILE).is_file():
        return path
    run = run_of_checkpoint(path)
    if run is not None and RunFolder(run).config.is_file():
        return run
    return None


def resume_value(overrides: list[str]) -> str | None:
    """The value of the last `resume=` override (the config is not loaded yet)."""
    found = None
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip() == "resume":
            found = value or None
    return found


def config_source(config_path: str | None, overrides: list[str]) -> str | None:
    """The config file a run loads: the resumed run's own config.json when `resume=` names a
    run (overrides on the command line still apply), else `--config`."""
    run = run_of(resume_value(overrides))
    if run is None:
        return config_path
    config_file = RunFolder(run).config
    if config_path is not None:
        raise ConfigError(
            f"--config: resume={run} continues that run with its own {config_file.name}; "
            "give changes as key=value instead of a config file"
        )
    return str(config_file)


def load_run_config(config_path: str | None, overrides: list[str]) -> TrainConfig:
    """The config of `dorarl train`: `--config` (or the resumed run's config.json) with the
    overrides. Relative paths in `--config` resolve against its folder; a run's config.json
    records the paths its run used, absolute, or relative as that run read them: against
    the working directory. `engine.max_model_len` given by neither follows the model
    (dorarl.jobs.model_context)."""
    source = config_source(config_path, overrides)
    recorded = run_of(resume_value(overrides)) is not None
    config = load_config(
        TrainConfig, source, overrides, paths_from=Path.cwd() if recorded else None
    )
    tree = yaml.safe_load(Path(source).read_text()) if source is not None else None
    if context_given(tree if isinstance(tree, dict) else {}, overrides):
        return config
    return with_model_context(config)


def choose_out(out: str | None, resume: str | None, mode: str) -> Path:
    """The run folder: `--out`, else the resumed run's, else a new runs/<time>-<mode>-<pid>.
    Refuses (ConfigError) a file, or a non-empty folder that is not the resumed run."""
    resumed = run_of(resume)
    if out is None:
        if resumed is not None:
            return resumed
        return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{mode}-{os.getpid()}"
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out}: is a file; give a new or empty folder")
    if path.is_dir() and any(path.iterdir()):
        if resumed is not None and path.resolve() == resumed.resolve():
            return path
        raise ConfigError(
            f"--out {out}: not empty; give a new or empty folder, or continue the run in it "
            f"with resume={out}"
        )
    return path


def open_run_folder(out_dir: Path, config: Any, resume_version: int | None) -> None:
    """Create the folder and write config.json; resumed in its own folder at version V, move
    what was logged after V aside first."""
    run = RunFolder(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume_version is not None and run.metrics.is_file():
        roll_back(out_dir, resume_version)
    # to_dict leaves derived keys out: the file loads back as the run's config
    run.config.write_text(json.dumps(to_dict(config), indent=2) + "\n")


def roll_back(out_dir: Path, version: int) -> dict[str, int]:
    """Move everything of versions after `version` to rolled_back/: metrics rows of steps
    that made a later version, trajectory rows trained at `version` or later, evaluations
    of later versions, newer checkpoints, the segments whose every step made one;
    TensorBoard is rebuilt from the rows kept. Returns what moved, by kind (evaluations:
    when the run has them)."""
    run = RunFolder(out_dir)
    aside = run.rolled_back
    moved = {
        "metrics": _split_rows(run.metrics, aside.root, lambda r: r["new_version"] <= version),
        "trajectories": _split_rows(
            run.trajectories, aside.root, lambda r: _history_version(r) < version
        ),
        "checkpoints": _move_newer_checkpoints(run, aside, version),
        "segments": roll_back_segments(out_dir, aside.root, version),
    }
    if run.evaluations.is_file():  # a run that evaluated
        moved["evaluations"] = _split_rows(
            run.evaluations, aside.root, lambda r: r["version"] <= version
        )
    if (moved["metrics"] or moved.get("evaluations")) and run.tensorboard.is_dir():
        _rebuild_tensorboard(run)
    return moved


def _history_version(row: dict[str, Any]) -> int:
    """The version a trajectory row belongs to: the one it trained, or for a filtered group
    the newest when it was filtered (a checkpoint of V holds as untrained every group
    still outstanding when V was published, filtered later or not)."""
    return row["filtered_step"] if row.get("filtered") else row["train_version"]


def _split_rows(path: Path, aside: Path, keep: Any) -> int:
    """Keep the rows `keep` accepts in `path`, append the others to aside/<name>."""
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped: list[str] = []
    for line in path.read_text().splitlines():
        if line.strip():
            (kept if keep(json.loads(line)) else dropped).append(line)
    if dropped:
        aside.mkdir(exist_ok=True)
        with open(aside / path.name, "a") as f:
            f.write("".join(line + "\n" for line in dropped))
        path.write_text("".join(line + "\n" for line in kept))
    return len(dropped)


def _move_newer_checkpoints(run: RunFolder, aside: RunFolder, version: int) -> int:
    newer = [
        path
        for path in checkpoint_entries(run.checkpoints)
        if (found := checkpoint_version_strict(path)) is not None and found > version
    ]
    for path in newer:
        dest = aside.checkpoints / path.name
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        path.rename(dest)
    return len(newer)


def _rebuild_tensorboard(run: RunFolder) -> None:
    """TensorBoard shows what metrics.jsonl and evaluations.jsonl hold: the old event files
    go aside, the kept rows are written again (each evaluation at the step that made its
    version)."""
    from dorarl.jobs.evaluation import eval_scalars
    from dorarl.report.tensorboard import ScalarLogger

    aside = run.rolled_back
    aside.root.mkdir(exist_ok=True)
    run.tensorboard.rename(aside.root / f"{run.tensorboard.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines() if line.strip()]
    logger = ScalarLogger(run.root)
    for row in rows + eval_scalars(rows, read_evaluations(run.evaluations)):
        logger.log(row)
    logger.close()
