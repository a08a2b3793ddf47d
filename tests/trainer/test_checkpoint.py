"""Checkpoint round trip: weights, optimizer state, version, RNG and extra state; HF-loadable."""

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dorarl.errors import UserInputError
from dorarl.trainer import Trainer, TrainerConfig


def _config() -> TrainerConfig:
    return TrainerConfig(lr=1e-3, weight_decay=0.01, warmup_steps=3, micro_batch_tokens=64)


def test_round_trip_restores_weights_optimizer_version_and_rng(
    tiny_model_dir, tmp_path, make_groups
):
    trainer = Trainer.from_pretrained(tiny_model_dir, _config(), version=7)
    trainer.train_step(make_groups(seed=1, version=7))
    trainer.train_step(make_groups(seed=2, version=8))
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(9)
    folder = trainer.save_checkpoint(tmp_path / "ckpt", {"data_position": 42, "epoch": 1})
    expected_draws = (torch.rand(3), random.random(), np.random.rand())

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    resumed, extra = Trainer.resume(folder, _config())
    assert (torch.rand(3), random.random(), np.random.rand())[1:] == expected_draws[1:]
    assert extra == {"data_position": 42, "epoch": 1}
    assert resumed.version == 9 and resumed.optimizer_steps == 2
    _assert_same_weights(trainer, resumed)
    _assert_same_optimizer(trainer, resumed)
    # The strongest check: the next step is identical, so the Adam moments and the step
    # count (warmup, bias correction) were restored exactly.
    groups = make_groups(seed=3, version=9)
    m1 = trainer.train_step(groups)
    m2 = resumed.train_step(groups)
    assert m1["lr"] == m2["lr"] and resumed.version == trainer.version == 10
    _assert_same_weights(trainer, resumed)


def test_rng_draw_after_resume_matches_the_draw_after_save(tiny_model_dir, tmp_path):
    trainer = Trainer.from_pretrained(tiny_model_dir, _config())
    torch.manual_seed(321)
    folder = trainer.save_checkpoint(tmp_path / "ckpt")
    after_save = torch.rand(4)
    torch.manual_seed(0)
    Trainer.resume(folder, _config())
    assert torch.equal(torch.rand(4), after_save)


def _assert_same_weights(a: Trainer, b: Trainer) -> None:
    wa, wb = a.named_tensors(), b.named_tensors()
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _assert_same_optimizer(a: Trainer, b: Trainer) -> None:
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for idx, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][idx][key]), (idx, key)
    for ga, gb in zip(sa["param_groups"], sb["param_groups"], strict=True):
        assert {k: v for k, v in ga.items()} == {k: v for k, v in gb.items()}


def test_checkpoint_folder_loads_with_transformers(tiny_model_dir, tmp_path, make_groups):
    trainer = Trainer.from_pretrained(tiny_model_dir, _config())
    trainer.train_step(make_groups(seed=1))
    folder = trainer.save_checkpoint(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.encode("a1=") == [1, 69, 21, 33]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trainer.named_tensors()[name]), name
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["version"] == 1
    assert any(k.endswith(".exp_avg") for k in load_file(str(folder / "optimizer.safetensors")))


def test_saving_twice_replaces_the_folder_and_leaves_no_temporaries(tiny_model_dir, tmp_path):
    trainer = Trainer.from_pretrained(tiny_model_dir, _config())
    trainer.save_checkpoint(tmp_path / "ckpt", {"n": 1})
    trainer.version = 3
    trainer.save_checkpoint(tmp_path / "ckpt", {"n": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _, extra = Trainer.resume(tmp_path / "ckpt", _config())
    assert extra == {"n": 2}


def test_non_json_extra_state_and_missing_checkpoint_are_errors(tiny_model_dir, tmp_path):
    trainer = Trainer.from_pretrained(tiny_model_dir, _config())
    with pytest.raises(TypeError, match="JSON"):
        trainer.save_checkpoint(tmp_path / "ckpt", {"bad": object()})
    with pytest.raises(UserInputError, match="not a trainer checkpoint"):
        Trainer.resume(tiny_model_dir, _config())


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    from dorarl.trainer.checkpoint import STATE_FILE, prune, version_folders

    for v in (3, 12, 100, 7):
        (tmp_path / f"version_{v:05d}").mkdir()
        (tmp_path / f"version_{v:05d}" / STATE_FILE).write_text("{}")
    (tmp_path / "version_00200.tmp").mkdir()  # an interrupted rewrite: never counted
    (tmp_path / "version_00300").mkdir()  # no state file: not a checkpoint
    names = [p.name for p in version_folders(tmp_path)]
    assert names == ["version_00003", "version_00007", "version_00012", "version_00100"]
    assert [p.name for p in prune(tmp_path, keep=2)] == ["version_00003", "version_00007"]
    assert [p.name for p in version_folders(tmp_path)] == ["version_00012", "version_00100"]
    assert prune(tmp_path, keep=0) == [] and len(version_folders(tmp_path)) == 2


def test_a_write_that_dies_midway_leaves_the_previous_checkpoint_newest(
    tiny_model_dir, tmp_path, monkeypatch
):
    from dorarl.jobs.resume import find_checkpoint
    from dorarl.trainer import checkpoint as ckpt

    trainer = Trainer.from_pretrained(tiny_model_dir, _config())
    trainer.save_checkpoint(tmp_path / "checkpoints" / "version_00001", {"n": 1})
    written = []

    def dies_after_the_weights(path, tensors):  # the trainer's process dies mid-write
        written.append(path.name)
        raise KeyboardInterrupt("killed while writing " + path.name)

    monkeypatch.setattr(ckpt, "save_tensors", dies_after_the_weights)
    for name in ("version_00002", "version_00001"):  # a new version, and a rewrite
        with pytest.raises(KeyboardInterrupt):
            trainer.save_checkpoint(tmp_path / "checkpoints" / name, {"n": 2})
    assert written == ["optimizer.safetensors"] * 2  # the model was written, then the crash
    assert find_checkpoint(tmp_path).name == "version_00001"
    assert Trainer.resume(find_checkpoint(tmp_path), _config())[1] == {"n": 1}

    monkeypatch.undo()
    trainer.save_checkpoint(
        tmp_path / "checkpoints" / "version_00003",
        {"n": 3},
    )
    ckpt.prune(tmp_path / "checkpoints", keep=0)  # the dead writes' .tmp folders go
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["version_00001", "version_00003"]


def test_a_rewrite_that_dies_between_its_renames_keeps_the_displaced_copy(tmp_path):
    from dorarl.trainer.checkpoint import STATE_FILE, version_folders, write_atomically

    folder = tmp_path / "version_00004"
    write_atomically(folder, lambda tmp: (tmp / STATE_FILE).write_text('{"n": 1}'))
    folder.rename(tmp_path / "version_00004.old")  # the first rename of a rewrite, then death
    (tmp_path / "version_00004.tmp").mkdir()
    assert version_folders(tmp_path) == [tmp_path / "version_00004.old"]  # still readable

    def dies(tmp):
        raise OSError("disk full")

    with pytest.raises(OSError):  # the next write puts the copy back before it starts
        write_atomically(folder, dies)
    assert version_folders(tmp_path) == [folder]
    assert (folder / STATE_FILE).read_text() == '{"n": 1}'
    write_atomically(folder, lambda tmp: (tmp / STATE_FILE).write_text('{"n": 2}'))
    assert (folder / STATE_FILE).read_text() == '{"n": 2}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_00004"]


def test_checkpoints_keep_the_tokenizer_after_the_folder_resumed_from_is_pruned(
    tiny_model_dir, tmp_path, make_groups
):
    from dorarl.trainer.checkpoint import prune

    checkpoints = tmp_path / "checkpoints"
    first = Trainer.from_pretrained(tiny_model_dir, _config())
    resumed_from = first.save_checkpoint(checkpoints / "version_00000")
    trainer, _ = Trainer.resume(resumed_from, _config())
    for version in range(3):  # more checkpoints than kept: the one resumed from goes
        trainer.train_step(make_groups(seed=version, version=version))
        trainer.save_checkpoint(checkpoints / f"version_{trainer.version:05d}")
        prune(checkpoints, keep=2)
    assert not resumed_from.exists()
    newest = checkpoints / "version_00003"
    again, _ = Trainer.resume(newest, _config())
    tokenizer = AutoTokenizer.from_pretrained(newest)
    assert tokenizer.decode(tokenizer("12+3")["input_ids"]).replace(" ", "").endswith("12+3")
    assert again.tokenizer_files == first.tokenizer_files != {}


def test_an_older_checkpoint_drops_its_optimizer_state_and_resumes_with_a_fresh_one(
    tiny_model_dir, tmp_path, make_groups, caplog
):
    from dorarl.trainer import checkpoint as ckpt

    trainer = Trainer.from_pretrained(tiny_model_dir, _config())
    trainer.train_step(make_groups(seed=1))
    older = trainer.save_checkpoint(tmp_path / "version_00001")
    trainer.train_step(make_groups(seed=2, version=1))
    newest = trainer.save_checkpoint(tmp_path / "version_00002")
    assert ckpt.drop_older_optimizer_state(tmp_path) == [older]
    assert ckpt.drop_older_optimizer_state(tmp_path) == []  # done once
    assert not (older / ckpt.OPTIMIZER_FILE).exists() and (newest / ckpt.OPTIMIZER_FILE).is_file()
    assert json.loads((older / ckpt.STATE_FILE).read_text())["optimizer"] is None

    exact, _ = Trainer.resume(newest, _config())
    _assert_same_optimizer(trainer, exact)
    with caplog.at_level("WARNING"):
        fresh, _ = Trainer.resume(older, _config())
    assert "holds no optimizer state: AdamW starts afresh" in caplog.text
    assert fresh.version == 1 and fresh.optimizer_steps == 1 and not fresh.optimizer.state
    assert fresh.train_step(make_groups(seed=3, version=1))["update_applied"] == 1.0


def test_dropping_a_sharded_checkpoints_optimizer_state_takes_its_shards(tmp_path):
    from dorarl.trainer import checkpoint as ckpt

    folder = tmp_path / "version_00004"
    (folder / "shards").mkdir(parents=True)
    (folder / "shards" / "rank0.safetensors").write_bytes(b"x")
    (folder / ckpt.STATE_FILE).write_text(json.dumps({"version": 4, "optimizer": {"a": 1}}))
    ckpt.drop_optimizer_state(folder)
    assert not (folder / "shards").exists() and not ckpt.has_optimizer_state(folder)
    assert sorted(p.name for p in folder.iterdir()) == [ckpt.STATE_FILE]
