"""`dorarl bench peers`: the line naming trl when it is missing, prompt texts that TRL
tokenizes back to our ids, and (slow) both sides on the shipped tiny base: the JSON's shape
and the same prompt token ids on both sides."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dorarl.bench import peers_trl
from dorarl.cli import main as cli_main
from dorarl.tasks.assets import shipped_base_model

TINY = """\
mode: dora
K: 1
steps: 2
instances: 1
rbs: 3
tbs: 2
group_size: 4
checkpoint_every: 0
sampling:
  max_new_tokens: 16
eval:
  every: 1
  max_prompts: 8
"""


def test_without_trl_it_exits_2_naming_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(peers_trl.importlib.util, "find_spec", lambda name: None)
    assert cli_main(["bench", "peers", "--model", "m", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trl" in err[0] and ".[peers]" in err[0]


def test_prompt_text_gives_back_the_ids_with_the_tokenizers_own_prefix():
    tokenizer = AutoTokenizer.from_pretrained(shipped_base_model())
    ids = tokenizer("a3b7c0=")["input_ids"]  # the tokenizer adds <bos> itself
    text = peers_trl.prompt_text(tokenizer, ids)
    assert tokenizer(text)["input_ids"] == ids


def _bench_tiny(tmp_path: Path, *options: str) -> tuple[Path, dict]:
    """`dorarl bench peers` on the shipped tiny base with the TINY workload: its folder and
    peers.json."""
    pytest.importorskip("trl")
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "out"
    argv = ["bench", "peers", "--model", str(shipped_base_model()), "--out", str(out),
            "--config", str(config), *options]  # fmt: skip
    assert cli_main(argv) == 0
    return out, json.loads((out / "peers.json").read_text())


@pytest.mark.slow
def test_both_sides_on_the_tiny_base(tmp_path: Path, shared_ray):
    options = ["--record", str(tmp_path / "record.json"), "--trl-precision", "fp32,bf16"]
    _, result = _bench_tiny(tmp_path, *options)
    assert result["prompts"]["same_prompt_ids"] is True
    assert result["prompts"]["trl_batches"] == 2
    assert result["prompts"]["dorarl_prompts_also_in_trl"] > 0
    assert set(result["trl_runs"]) == {"fp32", "bf16"}
    assert result["trl"] == result["trl_runs"][result["settings"]["trl_precision"]]
    for got in (result["dorarl"], *result["trl_runs"].values()):
        assert got["run_wall_s"] > 0 and got["process_wall_s"] >= got["run_wall_s"]
        assert len(got["step_s"]) == 2 and got["tokens"] > 0 and got["tokens_per_s"] > 0
        assert set(got["held_out"]) == {"0", "2"}  # the versions `dorarl train` evaluates
    # the untrained model is the same on both sides, scored by the same evaluator
    assert result["trl"]["held_out"]["0"] == result["dorarl"]["held_out"]["0"]
    assert result["settings"]["trl_loss_type"] == "dapo" and result["unmatched"]
    record = json.loads((tmp_path / "record.json").read_text())
    assert record == result["record"] and record["bench"] == "peers"
    assert len(record["rows"]) == 3 and all(
        len(r) == len(record["columns"]) for r in record["rows"]
    )


def test_an_evaluation_the_run_lost_is_redone_from_its_checkpoint(tmp_path: Path, monkeypatch):
    from dorarl.bench import peers
    from dorarl.config import load_config
    from dorarl.jobs.config import TrainConfig

    train = load_config(TrainConfig, None, ["steps=4", "eval.every=2", "model=m"])
    (tmp_path / "checkpoints" / "version_00004").mkdir(parents=True)
    asked = {}
    monkeypatch.setattr(
        peers, "evaluate_folders", lambda t, task, folders: asked.update(folders) or {4: 0.5}
    )
    held_out = {0: 0.25}  # versions 2 and 4 lost; only 4 was checkpointed
    peers.fill_held_out(train, None, tmp_path, held_out)
    assert asked == {4: tmp_path / "checkpoints" / "version_00004"}
    assert held_out == {0: 0.25, 4: 0.5}


def test_trl_figure_is_the_fastest_run_that_converges():
    from dorarl.bench.peers import trl_figure

    def side(wall, last):
        return {"run_wall_s": wall, "held_out": {0: 0.2, 30: last}}

    # bf16 is faster and within 0.03 of fp32's accuracy: its figure
    assert trl_figure({"fp32": side(100, 0.72), "bf16": side(70, 0.70)}) == "bf16"
    # bf16 is faster but lost 5 points: fp32's
    assert trl_figure({"fp32": side(100, 0.72), "bf16": side(70, 0.67)}) == "fp32"
    assert trl_figure({"fp32": side(100, 0.60), "bf16": side(120, 0.70)}) == "bf16"
    assert trl_figure({"fp32": side(100, 0.60)}) == "fp32"


@pytest.mark.parametrize("value", ["fp16", "", "fp32,tf32"])
def test_an_unknown_trl_precision_exits_2_on_one_line(value, capsys):
    pytest.importorskip("trl")
    argv = ["bench", "peers", "--model", "m", "--out", "o", "--trl-precision", value]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("--trl-precision:")


@pytest.mark.slow
def test_a_seed_runs_the_whole_bench_in_a_process_of_its_own(tmp_path: Path, shared_ray):
    """--seeds starts `python -m dorarl bench peers ... seed=N` per seed (one seed here:
    the aggregation over several is test_peers_seeds'), and gathers its peers.json."""
    out, result = _bench_tiny(tmp_path, "--trl-precision", "bf16", "--seeds", "3")
    assert result["summary"]["seeds"] == [3] and set(result["by_seed"]) == {"3"}
    alone = json.loads((out / "seed-3" / "peers.json").read_text())
    assert alone == result["by_seed"]["3"]
    assert alone["settings"]["seed"] == 3 and alone["prompts"]["same_prompt_ids"]
    run = json.loads((out / "seed-3" / "dorarl" / "config.json").read_text())
    assert run["seed"] == 3  # the run dorarl wrote, not only the bench's settings
    walls = result["summary"]["dorarl"]["run_wall_s"]
    assert walls["mean"] == pytest.approx(alone["dorarl"]["run_wall_s"]) and walls["sd"] == 0
    assert len(result["record"]["rows"]) == 4


def test_the_notes_name_the_sequences_only_dorarl_leaves_uncomputed():
    import dataclasses

    from dorarl.bench import peers
    from dorarl.jobs.config import TrainConfig

    train = TrainConfig()
    skipping = peers.unmatched(train)
    assert any("skip_zero_advantage" in note for note in skipping)
    computing = dataclasses.replace(
        train, trainer=dataclasses.replace(train.trainer, skip_zero_advantage=False)
    )
    assert peers.unmatched(computing) == peers.UNMATCHED
