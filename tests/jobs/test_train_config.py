"""`TrainConfig` is settings only: it holds its fields and nothing else, reads no files (the
checkpoint `resume=` names is read by `dorarl train`), builds no runtime objects, and every
check of its keys' relations names the full dotted key, at the root and as a section."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from dorarl.bench.convergence import ConvergenceConfig
from dorarl.config import ConfigError, load_config
from dorarl.engine.config import EngineConfig
from dorarl.engine.vllm.config import vllm_missing
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.resume import ResumePoint
from dorarl.jobs.run_folder import load_run_config
from dorarl.jobs.train import resume_point

SOURCE = Path(__file__).resolve().parents[2] / "dorarl" / "jobs" / "config.py"


def test_the_config_holds_its_settings_and_reads_no_checkpoint(tmp_path):
    missing = tmp_path / "no-such-run"
    config = load_config(TrainConfig, None, [f"resume={missing}"])  # nothing read yet
    assert set(vars(config)) == {f.name for f in dataclasses.fields(TrainConfig)}
    with pytest.raises(ConfigError, match=f"^resume: {missing} is neither a checkpoint"):
        resume_point(config)
    assert resume_point(load_config(TrainConfig)) is None


def test_the_controller_starts_where_the_checkpoint_left_off(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    extra = {"version": 4, "first_group": 30, "first_prompt": 31, "resume_prompts": [7]}
    (folder / "trainer_state.json").write_text(json.dumps({"version": 4, "extra_state": extra}))
    config = load_config(TrainConfig, None, [f"resume={folder}", "steps=6"])
    point = resume_point(config)
    assert point == ResumePoint(folder, 4, 30, 31, [7])
    resumed = config.controller_config(point)
    assert (resumed.initial_version, resumed.first_group, resumed.resume_prompts) == (4, 30, [7])
    assert config.controller_config(None).initial_version == 0


def test_the_config_module_takes_only_settings_from_the_runtime():
    """Placement and the weight transport are built in dorarl.runtime from the sections; the
    config module imports nothing of it but the sections' own classes (`*_config`)."""
    tree = ast.parse(SOURCE.read_text())
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    runtime = {m for m in modules if m and m.startswith("dorarl.runtime")}
    assert runtime and all(m.endswith("_config") for m in runtime), runtime


CROSS_KEY_CASES = [
    (["rbs=2", "tbs=4"], "rbs"),
    (["group_size=9", "instances=1", "engine.max_num_seqs=8"], "group_size"),
    (["rollout.filter_groups=true", "group_size=1"], "rollout.filter_groups"),
    (["orchestrator.rebalance_period_s=.inf"], "orchestrator.rebalance_period_s"),
    (["trainer.loss.tis_cap=2"], "trainer.loss.tis_cap"),
    (["trainer.loss.overlong=soft"], "trainer.loss.overlong"),
    (["trainer.loss.overlong=soft", "sampling.max_new_tokens=32"], "trainer.loss.overlong_buffer"),
    (["trainer.loss.aggregation=seq_sum_norm"], "trainer.loss.norm_length"),
    (["trainer.loss.distill_coef=1"], "trainer.teacher"),
    (["trainer.loss.rl_coef=0"], "trainer.loss.rl_coef"),
    (["trainer.loss.norm_length=64"], "trainer.loss.norm_length"),
    (["trainer.loss.kind=cispo", "trainer.loss.dual_clip=3"], "trainer.loss.dual_clip"),
    (["trainer.loss.is_mask=token", "trainer.loss.is_mask_low=2"], "trainer.loss.is_mask_low"),
    (["forced_lengths.enabled=true", "forced_lengths.max_len=256"], "forced_lengths.max_len"),
    (["engine.num_blocks=1"], "engine.num_blocks"),
    (["engine.attention=cpp", "engine.dtype=bfloat16"], "engine.attention"),
    (["engine.device=cuda:1"], "engine.device"),
    (  # without vllm: what to install; with it, what vLLM engines cannot do (on cuda)
        ["engine.backend=vllm", "engine.record_routes=true", "engine.device=cuda"],
        "engine.backend" if vllm_missing() else "engine.record_routes",
    ),
    (["weights.transport=collective", "engine.device=cuda"], "weights.transport"),
    (["ray.engine_resources={CPU: 1}"], "ray.engine_resources"),
    (["ray.trainer_resources={learner: 0}"], "ray.trainer_resources.learner"),
    (["task.name=jsonl"], "task.path"),
    (["runtime=sim", "resume=somewhere"], "resume"),
]
"""Checks of a key against others (not bounds): one case each, the key it must name."""


@pytest.mark.parametrize(("overrides", "key"), CROSS_KEY_CASES)
def test_relations_between_keys_name_the_full_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}: .* \(command line\)$"):
        load_config(TrainConfig, None, overrides)


@pytest.mark.parametrize(("overrides", "key"), CROSS_KEY_CASES)
def test_as_a_section_they_name_the_key_under_it(overrides, key):
    """`dorarl bench convergence` holds a TrainConfig as `train`: the same checks name
    train.KEY (a component that names its own section is not named twice)."""
    nested = [f"train.{item}" for item in overrides]
    with pytest.raises(ConfigError, match=rf"^train\.{key}: "):
        load_config(ConvergenceConfig, None, nested)


def test_every_check_between_keys_is_reported():
    with pytest.raises(ConfigError) as refused:
        load_config(TrainConfig, None, ["rbs=2", "tbs=4", "trainer.loss.overlong=soft",
                                        "engine.device=gpu"])  # fmt: skip
    lines = str(refused.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("engine.device: use cpu or cuda")
    assert any(line.startswith("rbs: must be >= tbs") for line in lines)
    assert any(line.startswith("trainer.loss.overlong: soft needs sampling.max_new_tokens")
               for line in lines)  # fmt: skip


def test_a_response_cap_over_the_context_is_refused():
    with pytest.raises(ConfigError, match=r"^sampling.max_new_tokens: 256 leaves no room for the prompt under engine.max_model_len=256"):  # fmt: skip
        load_config(TrainConfig, None, ["sampling.max_new_tokens=256"]).check_response_cap()
    load_config(TrainConfig, None, ["sampling.max_new_tokens=255"]).check_response_cap()


def test_a_response_cap_is_checked_against_the_context_that_follows_the_model(tmp_path):
    """A user's model folder brings its context (dorarl.jobs.model_context): a cap over the
    default 256 but inside the model's context is fine."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"max_position_embeddings": 1024}')
    config = load_run_config(None, [f"model={folder}", "sampling.max_new_tokens=512"])
    assert config.engine.max_model_len == 1024
    config.check_response_cap()


@pytest.mark.skipif(vllm_missing() is not None, reason="vllm is not installed here")
def test_a_vllm_run_loads_from_the_trainer_and_relieves_by_migration_only():
    """Engines that serve no weights and offload no KV get neither planned (their
    capabilities, whatever orchestrator.* says); our engine's keep both."""
    ours = TrainConfig().controller_config(None).orchestrator
    assert ours.p2p_weights and ours.engine_offload
    vllm = TrainConfig(engine=EngineConfig(backend="vllm")).controller_config(None).orchestrator
    assert not vllm.p2p_weights and not vllm.engine_offload
