import json

import pytest

from dorarl.config import ConfigError
from dorarl.simulate.cli import main

TINY = [
    "controller.instances=2",
    "controller.slots=8",
    "controller.group_size=2",
    "controller.tbs=2",
    "controller.rbs=3",
    "controller.steps=3",
    "lengths.median=20",
    "lengths.max_len=200",
]


def test_simulate_writes_every_mode_and_a_comparison(tmp_path):
    assert main(["--out", str(tmp_path), "--modes", "sync,dora", *TINY]) == 0
    results = json.loads((tmp_path / "modes.json").read_text())
    assert set(results) == {"sync", "dora"}
    for mode in ("sync", "dora"):
        files = {p.name for p in (tmp_path / mode).iterdir()}
        assert files == {"metrics.jsonl", "trajectories.jsonl", "summary.json", "trace.json"}
        assert results[mode]["steps"] == 3 and results[mode]["dropped_total"] == 0


def test_simulate_rejects_unknown_modes_and_keys(tmp_path):
    with pytest.raises(ConfigError, match="--modes"):
        main(["--out", str(tmp_path), "--modes", "async"])
    with pytest.raises(ConfigError, match="controller.nope"):
        main(["--out", str(tmp_path), "controller.nope=1"])
