"""Engine and trainer workers: `reset` gives the state of a freshly started actor (base weights,
version 0, nothing in flight, fresh pace counts), so benchmarks can reuse actors across modes;
a new trainer waits for the versions it is asked for before it made them; an engine
handed the trainer's handle loads none of the trainer's code; and an engine refuses a
load whose copy into its own weights does not match the sender's manifest."""

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_model import save_with_head_dim
from transformers import LlamaConfig, LlamaForCausalLM

import dorarl.engine.engine_versions as versions_module
from dorarl.data import Group, Sample
from dorarl.engine import EngineConfig, SamplingParams
from dorarl.engine.weights import unpack
from dorarl.record.pacing import DeviceModel
from dorarl.runtime.actors import actor_options
from dorarl.runtime.transfer.weight_endpoints import WeightServing
from dorarl.runtime.transfer.weight_layout import WeightsRefused, build_manifest, wire_tensors
from dorarl.runtime.workers.engine_worker import NO_VERSION, EngineWorker, NewRequest
from dorarl.runtime.workers.trainer_worker import TrainerWorker
from dorarl.trainer import TrainerConfig

PROMPT = [1, 5, 6, 7]


def _generate(worker: EngineWorker, rid: str) -> list[int]:
    worker.add([NewRequest(rid, PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0))])
    outputs = []
    while not outputs:
        outputs = worker.run(max_steps=16).finished
    return outputs[0].output_ids


def test_engine_reset_restores_base_weights_and_drops_requests(tiny_model_dir):
    dev = DeviceModel(decode_step_s=1e-4)
    # the cache off: both rows prefill the same prompt in the first step (with it, the
    # second waits for the first's prompt blocks)
    config = EngineConfig(max_num_seqs=2, max_model_len=64, prefix_cache="off")
    worker = EngineWorker(0, str(tiny_model_dir), config, pace=dev)
    fresh = _generate(worker, "a")
    noisy = {k: v + 0.5 * torch.randn_like(v) for k, v in worker.weights().items()}
    worker.load_weights(noisy, version=3)
    assert _generate(worker, "b") != fresh  # the swapped weights really changed the policy
    worker.add([NewRequest("left", PROMPT, SamplingParams(max_new_tokens=6))])
    worker.run(max_steps=1, until_finished=False)

    assert worker.reset() == 0
    stats = worker.stats()
    assert stats.version == 0 and stats.running == stats.waiting == stats.tokens_generated == 0
    assert worker.pacer.stats.steps == 0
    assert _generate(worker, "c") == fresh


def test_a_peer_serves_only_the_version_it_hosts(tiny_model_dir):
    """A replacement engine still taking its instance's version back hosts its start-up
    weights: asked for that version by a peer it refuses, never serving them under its
    name (the peer would refuse them by fingerprint and the run would stop)."""
    worker = EngineWorker(0, str(tiny_model_dir), EngineConfig(max_num_seqs=2, max_model_len=64))
    assert set(worker.weights(0)) == set(worker.weights())
    with pytest.raises(WeightsRefused, match="instance 0 does not host version 21 .it hosts 0."):
        worker.weights(21)
    worker.load_weights(worker.weights(), version=21)
    assert set(worker.weights(21)) == set(worker.weights())


def test_a_version_change_finds_both_kv_pools_empty(tiny_model_dir):
    """Requests free their KV blocks as they leave (export, abort), so loading another
    version frees only the prefix cache's idle blocks (bookkeeping); load_weights refuses
    while a request is still here. A run's report counts the prompt tokens it computed and
    those the cache gave: three samples of one prompt compute it once, then a token each."""
    config = EngineConfig(max_num_seqs=4, block_size=4, max_model_len=64, host_blocks=32)
    worker = EngineWorker(0, str(tiny_model_dir), config)
    params = SamplingParams(max_new_tokens=30, stop_token_ids=[])
    worker.add([NewRequest(f"r{i}", PROMPT, params) for i in range(3)])
    report = worker.run(max_steps=4, until_finished=False)
    assert (report.prefill_tokens, report.saved_tokens) == (4 + 2, 2 * 3)
    assert worker.offload("r0")
    stats = worker.stats()
    assert stats.kv_blocks_used > 0 and stats.host_blocks_used > 0
    with pytest.raises(RuntimeError, match="in flight"):
        worker.load_weights(worker.weights(), version=1)
    ids, snapshots = worker.export(["r0", "r1"])
    assert ids == ["r0", "r1"] and len(snapshots) == 2 and len(worker.abort(["r2"])) == 1
    stats = worker.stats()
    assert stats.kv_blocks_used == 0 and stats.host_blocks_used == 0
    assert stats.kv_blocks_cached > 0  # the prompt's block, idle
    report = worker.load_weights(worker.weights(), version=1)
    assert report.version == 1 and report.load_s > 0
    assert worker.stats().kv_blocks_cached == 0
    assert not hasattr(report, "free_cache_s")  # nothing freed, so no figure claims it was


def test_trainer_reset_restores_base_weights_version_and_optimizer(tiny_model_dir):
    worker = TrainerWorker(str(tiny_model_dir), TrainerConfig(lr=1e-2))
    base = {k: v.clone() for k, v in worker.weights().items()}
    samples = [Sample(0, i, 0, [1, 5, 6], [7, 8, 9], [-1.0] * 3, [0] * 3, reward=float(i))
               for i in range(2)]  # fmt: skip
    worker.train_step([Group(0, 0, 0, samples)])
    assert worker.version() == 1
    assert any(not torch.equal(base[k], v) for k, v in worker.weights().items())

    assert worker.reset() == 0 and worker.version() == 0
    assert all(torch.equal(base[k], v) for k, v in worker.weights().items())
    metrics = worker.train_step([Group(1, 1, 0, samples)])
    assert metrics["version"] == 1.0  # a fresh optimizer step, numbered from the base


def test_a_checkpoint_write_reports_its_size_and_leaves_the_optimizer_to_the_newest(
    tiny_model_dir, tmp_path
):
    from dorarl.trainer.checkpoint import OPTIMIZER_FILE, folder_bytes, has_optimizer_state

    worker = TrainerWorker(str(tiny_model_dir), TrainerConfig(lr=1e-2))
    checkpoints = tmp_path / "checkpoints"
    written = [
        worker.save_checkpoint(str(checkpoints / f"version_{v:05d}"), {}, 2) for v in (1, 2, 3)
    ]
    assert [w.path for w in written] == [str(checkpoints / f"version_{v:05d}") for v in (1, 2, 3)]
    newest, older = checkpoints / "version_00003", checkpoints / "version_00002"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["version_00002", "version_00003"]
    assert has_optimizer_state(newest) and (newest / OPTIMIZER_FILE).is_file()
    assert not has_optimizer_state(older) and not (older / OPTIMIZER_FILE).exists()
    assert written[-1].bytes == folder_bytes(newest) > folder_bytes(older) > 0
    line = written[-1].line()
    assert line.startswith(f"checkpoint: {newest} (") and line.endswith("s)") and " GB, " in line


def test_a_new_trainer_asked_for_a_version_it_has_not_made_yet_waits_for_it(tiny_model_dir):
    """A replacement trainer is asked (export_weights, on its weights thread) for the versions
    it replays before its first publish: it waits for them instead of refusing."""
    worker = TrainerWorker(str(tiny_model_dir), TrainerConfig(lr=1e-2))
    samples = [Sample(0, i, 0, [1, 5, 6], [7, 8, 9], [-1.0] * 3, [0] * 3, reward=float(i))
               for i in range(2)]  # fmt: skip
    with ThreadPoolExecutor(1) as weights_thread:
        asked = weights_thread.submit(worker.export_weights, 1)
        time.sleep(0.2)
        assert not asked.done()
        serving = WeightServing("collective", "float32", 1 << 20, window=3)
        worker.train_step_and_weights([Group(0, 0, 0, samples)], serving)
        exported = asked.result(timeout=30)
    assert all(torch.equal(exported[k], v) for k, v in worker.weights().items())


def test_an_engine_handed_the_trainers_handle_imports_none_of_the_trainer():
    """Ray imports the module of every actor handle it deserializes: an engine handed the
    trainer's (each load over the group) must not load the trainer's code (it took 1.8 s
    and 200 MB, and made each engine's first collective load 1.1-1.8 s)."""
    probe = (
        "import sys, dorarl.runtime.workers.engine_worker; before = set(sys.modules); "
        "import dorarl.runtime.workers.trainer_worker, dorarl.runtime.workers.trainer_group; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    added = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    heavy = [m for m in added if m.startswith(("torch.", "transformers"))]
    assert not heavy and "dorarl.trainer.trainer" not in added, added


def test_an_actor_on_cuda_without_a_plan_asks_ray_for_one_gpu():
    sends = {"concurrency_groups": {"weights": 1}}  # weight sends beside the actor's calls
    assert actor_options("engine0", "cuda", None) == {"num_cpus": 0, "num_gpus": 1, **sends}
    assert actor_options("trainer", "cuda:0", None)["num_gpus"] == 1
    assert actor_options("evaluator", "cpu", None) == {"num_cpus": 0, "num_gpus": 0, **sends}


def test_a_paced_step_lasts_the_device_time_of_the_work_the_engine_reports(tiny_model_dir):
    dev = DeviceModel(decode_step_s=1e-3, prefill_token_s=1e-4, kv_token_s=1e-5)
    # the cache off: both rows prefill the same prompt in the first step (with it, the
    # second waits for the first's prompt blocks)
    config = EngineConfig(max_num_seqs=2, max_model_len=64, prefix_cache="off")
    worker = EngineWorker(0, str(tiny_model_dir), config, pace=dev)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=[])
    worker.add([NewRequest(r, PROMPT, params) for r in ("a", "b")])
    charged = []
    while worker.engine.has_unfinished():
        report = worker.run(max_steps=1, until_finished=False)
        work = worker.engine.last_step
        charged.append(dev.engine_step_s(work.extra_tokens, work.resident_tokens))
        assert report.busy_slots == [work.rows] == [2]
    # The prefill step charges both prompts beyond one token a row; decodes their KV.
    assert charged[0] == dev.engine_step_s(2 * (len(PROMPT) - 1), 2 * len(PROMPT))
    assert report.pace.steps == 1 and report.pace.paced_s == charged[-1]


def _odd_heads(tmp_path, tiny_model_dir):
    """A model folder whose config.json does not match its weights (head_dim 24 of 16)."""
    return save_with_head_dim(tiny_model_dir, tmp_path / "odd_heads", 24)


def test_an_engine_reports_its_setup_and_raises_a_refused_setting_at_its_first_call(
    tmp_path, tiny_model_dir
):
    from dorarl.errors import UserInputError

    config = EngineConfig(max_num_seqs=2, max_model_len=64)
    setup = EngineWorker(0, str(tiny_model_dir), config).started()
    assert (setup.kv_blocks, setup.block_size, setup.fast_path_fallbacks) == (
        config.kv_blocks, config.block_size, [],
    )  # fmt: skip
    # the CPU: the pool planned in a share of the host memory, all the blocks it wants fit
    assert setup.sampler == "host" and "KV 8 blocks" in setup.kv_budget
    refused = EngineWorker(0, str(_odd_heads(tmp_path, tiny_model_dir)), config)  # no raise
    for call in (refused.started, refused.stats):
        with pytest.raises(UserInputError, match="has shape"):
            call()


@pytest.mark.slow
def test_a_setting_an_engine_actor_refuses_reaches_the_driver_as_itself(tmp_path, tiny_model_dir):
    """Raised in the actor's constructor it would arrive as the actor's death (Ray's report,
    the error inside its text), and engine recovery would restart it into the same error."""
    import ray

    from dorarl.errors import UserInputError
    from dorarl.runtime.local_ray import start_local_ray
    from dorarl.runtime.ray_runtime import _started

    start_local_ray(num_cpus=1)
    try:
        config = EngineConfig(max_num_seqs=2, max_model_len=64)
        options = actor_options("engine0", "cpu", None)
        bad = ray.remote(**options)(EngineWorker).remote(
            0, str(_odd_heads(tmp_path, tiny_model_dir)), config
        )
        with pytest.raises(UserInputError) as refused:
            _started([bad])
        assert "\n" not in str(refused.value) and "has shape" in str(refused.value)
    finally:
        ray.shutdown()


def _sent(named: dict[str, torch.Tensor], version: int):
    """`named` as the trainer sends it in float32 (the CPU engines' dtype): its manifest."""
    return build_manifest(wire_tensors(named, torch.float32), version, bucket_bytes=1 << 16)


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"]
)
def test_a_copy_that_changes_the_engines_weights_is_refused_in_one_line(
    tiny_model_dir, monkeypatch, name
):
    """The check after the copy reads the engine's own tensors (here slices of the fused
    q|k|v and gate|up matrices): two sign flips of one row written there by a faulty copy
    are refused, and the engine then hosts no version."""
    worker = EngineWorker(0, str(tiny_model_dir), EngineConfig(max_num_seqs=2, max_model_len=64))
    named = {n: t + 0.01 for n, t in worker.weights().items()}
    assert worker.load_weights(named, 2, _sent(named, 2)).version == 2  # a right copy passes
    copy = versions_module.load_in_place

    def faulty(spec, live, new):
        copy(spec, live, new)
        unpack(spec, live)[name].view(torch.int32).view(-1)[[3, 40]] ^= -(2**31)

    monkeypatch.setattr(versions_module, "load_in_place", faulty)
    named = {n: t - 0.02 for n, t in named.items()}
    with pytest.raises(WeightsRefused) as refused:
        worker.load_weights(named, 3, _sent(named, 3))
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(
        f"weights of version 3 refused on instance 0 after the copy: tensor {name!r}"
    )
    assert worker.stats().version == NO_VERSION


def test_a_tied_engine_checks_a_sent_output_layer_against_its_embedding(tmp_path):
    """A sender whose tied alias came apart (gathered shards are copies) sends lm_head.weight
    too: the engine's output layer is its embedding, which must hold those bits."""
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    config = LlamaConfig(
        **sizes, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    worker = EngineWorker(0, str(tmp_path), EngineConfig(max_num_seqs=2, max_model_len=32))
    named = worker.weights()
    named["lm_head.weight"] = named["model.embed_tokens.weight"].clone()
    assert worker.load_weights(named, 1, _sent(named, 1)).version == 1
    named["lm_head.weight"].view(torch.int32)[0, 0] ^= 1
    with pytest.raises(WeightsRefused, match="after the copy: tensor 'lm_head.weight'"):
        worker.load_weights(named, 2, _sent(named, 2))
