"""MoE routing in the trainer: on CPU in float32 its routes equal the engine's recorded ones on
every token, the mismatch metric counts what differs, routing replay (R3) routes through the
engine's experts, the load-balancing loss is transformers' on one sequence, and the step's
expert load is counted."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

from dorarl.data import Group, Sample
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.trainer import Trainer, TrainerConfig
from dorarl.trainer.config import MoeConfig
from dorarl.trainer.moe import RouteStats, route_rows
from dorarl.trainer.packing import micro_batches
from dorarl.trainer.trainer import trainable_sequences

pytestmark = pytest.mark.usefixtures("single_thread")

SHAPE = dict(
    vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    pad_token_id=0, eos_token_id=2,
)  # fmt: skip
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SHAPE, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True,
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[1],
    ),
    "mixtral": lambda: MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
}  # fmt: skip


def save_moe(folder, arch: str, seed: int = 0):
    """A random MoE folder whose routers are decisive (std 0.5, as a trained router's are),
    not the near-uniform routing of a fresh init."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch]())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(folder))
    return folder


def engine_groups(trainer: Trainer, n_groups: int = 2, group_size: int = 4) -> list[Group]:
    """Groups sampled by an engine on the trainer's weights, with their routes recorded."""
    config = EngineConfig(
        max_num_seqs=8, block_size=4, num_blocks=128, max_model_len=64, record_routes=True
    )
    engine = Engine.from_hf_config(
        trainer.model.config, config, trainer.named_tensors(), trainer.version
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [
        [1] + torch.randint(4, 60, (5 + 4 * g,), generator=gen).tolist() for g in range(n_groups)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=14, stop_token_ids=[], seed=5)
    for g, prompt in enumerate(prompts):
        for i in range(group_size):
            engine.add_request(f"{g}-{i}", prompt, SamplingParams(**{**vars(params), "seed": i}))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    groups = []
    for g, prompt in enumerate(prompts):
        samples = [
            _sample(g, i, prompt, outs[f"{g}-{i}"], trainer.version) for i in range(group_size)
        ]
        groups.append(Group(group_id=g, prompt_id=g, version=trainer.version, samples=samples))
    return groups


def _sample(g: int, i: int, prompt: list[int], out, version: int) -> Sample:
    return Sample(
        group_id=g, sample_index=i, prompt_id=g, prompt_ids=prompt,
        response_ids=out.output_ids, logprobs=out.logprobs,
        versions=[version] * len(out.output_ids), reward=float(i % 2), routes=out.routes,
    )  # fmt: skip


def _config(**moe) -> TrainerConfig:
    return TrainerConfig(lr=1e-3, micro_batch_tokens=40, moe=MoeConfig(**moe))


@pytest.mark.parametrize("packing", ["shared_prompt", "padded"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_the_trainer_routes_every_sampled_token_as_the_engine_did(tmp_path, arch, packing):
    trainer = Trainer.from_pretrained(save_moe(tmp_path, arch), TrainerConfig(packing=packing))
    groups = engine_groups(trainer)
    tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
    metrics = trainer.accumulate_gradients(groups)
    assert metrics["moe_routes_compared"] == tokens
    assert metrics["moe_route_mismatch"] == 0.0
    assert metrics["moe_routes_compared_same_version"] == tokens
    assert metrics["moe_route_mismatch_same_version"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    sparse = len(trainer.routing.routers)
    counted = sum(metrics["moe_tokens_per_expert"].values())
    assert counted == tokens * sparse * trainer.routing.top_k
    assert metrics["moe_imbalance_max"] >= metrics["moe_imbalance"] >= 1.0


def _corrupt(groups: list[Group], every: int, experts: int, top_k: int) -> int:
    """Replace the first layer's route of every `every`-th token by other experts; returns
    how many tokens were changed."""
    changed = 0
    for s in (s for g in groups for s in g.samples):
        routes = bytearray(s.routes)
        width = len(routes) // len(s.response_ids)
        for t in range(0, len(s.response_ids), every):
            chosen = set(routes[t * width : t * width + top_k])
            others = [e for e in range(experts) if e not in chosen][:top_k]
            routes[t * width : t * width + top_k] = bytes(others)
            changed += 1
        s.routes = bytes(routes)
    return changed


def test_the_mismatch_metric_counts_the_tokens_whose_routes_differ(tmp_path):
    trainer = Trainer.from_pretrained(save_moe(tmp_path, "qwen3_moe"), _config())
    groups = engine_groups(trainer)
    tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
    changed = _corrupt(groups, every=3, experts=8, top_k=2)
    metrics = trainer.accumulate_gradients(groups)
    assert metrics["moe_route_mismatch"] == pytest.approx(changed / tokens)


def test_stale_tokens_are_told_apart_from_those_of_the_trainers_own_weights(tmp_path):
    trainer = Trainer.from_pretrained(save_moe(tmp_path, "qwen3_moe"), TrainerConfig(lr=3e-2))
    stale = engine_groups(trainer)
    trainer.train_step(engine_groups(trainer))  # now at version 1: the policy moved
    fresh = engine_groups(trainer)
    metrics = trainer.accumulate_gradients(stale + fresh)
    tokens = sum(len(s.response_ids) for g in fresh for s in g.samples)
    assert metrics["moe_routes_compared_same_version"] == tokens
    assert metrics["moe_route_mismatch_same_version"] == 0.0
    assert metrics["moe_route_mismatch"] > 0.0  # the stale ones' routes moved with the weights


def _logprobs(trainer: Trainer, groups: list[Group]) -> torch.Tensor:
    seqs = trainable_sequences(groups, trainer.config.loss)
    (batch,) = micro_batches(seqs, 10**6, "padded", trainer.pad_id, "cpu")
    trainer.routing.open(batch)
    try:
        logp, _ = trainer._policy_logprobs(batch)
        trainer.routing.forward_done()
    finally:
        trainer.routing.close()
    return logp[batch.mask].detach()


def test_route_replay_sends_tokens_through_the_engines_experts(tmp_path):
    folder = save_moe(tmp_path, "mixtral")
    own = Trainer.from_pretrained(folder, _config())
    replay = Trainer.from_pretrained(folder, _config(route_replay=True))
    groups = engine_groups(own, n_groups=1, group_size=2)
    # The engine's own routes replayed: bit for bit the trainer's own computation.
    assert torch.equal(_logprobs(replay, groups), _logprobs(own, groups))
    honest = _logprobs(own, groups)
    _corrupt(groups, every=5, experts=4, top_k=2)  # tokens 0, 5, 10, ... of each response
    forced = _logprobs(replay, groups)
    assert torch.equal(_logprobs(own, groups), honest)  # without replay nothing changes
    first = [0, *[len(s.response_ids) for s in groups[0].samples[:-1]]]
    starts = torch.tensor(first).cumsum(0)
    assert (forced[starts] != honest[starts]).all()  # a forced token's own logits move
    metrics = replay.accumulate_gradients(groups)
    gate = replay.model.model.layers[0].mlp.gate.weight.grad
    assert gate is not None and gate.abs().sum() > 0  # the router still learns under replay
    assert metrics["moe_route_mismatch"] > 0


def test_replay_needs_recorded_routes_in_the_run_config():
    from dorarl.config import ConfigError, load_config
    from dorarl.jobs.config import TrainConfig

    with pytest.raises(ConfigError, match="trainer.moe.route_replay: needs engine.record_routes"):
        load_config(TrainConfig, overrides=["trainer.moe.route_replay=true"])
    with pytest.raises(ConfigError, match="trainer.moe.aux_loss_coef: must be >= 0"):
        load_config(TrainConfig, overrides=["trainer.moe.aux_loss_coef=-1"])


def test_the_aux_loss_of_one_sequence_is_transformers_load_balancing_loss(tmp_path):
    trainer = Trainer.from_pretrained(save_moe(tmp_path, "qwen2_moe"), _config(aux_loss_coef=0.1))
    groups = engine_groups(trainer, n_groups=1, group_size=1)
    sample = groups[0].samples[0]
    metrics = trainer.accumulate_gradients(groups)
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = trainer.model(ids, output_router_logits=True).router_logits[0]  # layer 0 only
    rows = logits[len(sample.prompt_ids) - 1 : -1]
    want = load_balancing_loss_func((rows,), 8, 2)
    assert metrics["moe_aux_loss"] == pytest.approx(float(want), rel=1e-5)
    assert trainer.model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_route_rows_point_at_the_positions_that_predict_sampled_tokens(tmp_path, make_groups):
    trainer = Trainer.from_pretrained(save_moe(tmp_path, "qwen3_moe"), _config())
    seqs = trainable_sequences(make_groups(seed=4), trainer.config.loss)
    for packing in ("padded", "shared_prompt"):
        for batch in micro_batches(seqs, 60, packing, trainer.pad_id, "cpu"):
            rows = route_rows(batch, 8, 2, 2)
            flat = batch.input_ids.flatten()
            # the token after each predicting position is the sampled token it predicts
            targets = batch.targets[batch.mask] if packing == "padded" else batch.targets
            if packing == "padded":
                assert torch.equal(flat[rows.positions + 1], targets)
            assert rows.recorded is None and len(rows.positions) == int(batch.mask.sum())


def test_imbalance_is_the_mean_over_layers_of_max_over_mean():
    stats = RouteStats(torch.tensor([[4.0, 4.0, 4.0, 4.0], [10.0, 2.0, 2.0, 2.0]]))
    m = stats.metrics(aux_on=False)
    assert m["moe_imbalance"] == pytest.approx((1.0 + 2.5) / 2)
    assert m["moe_imbalance_max"] == pytest.approx(2.5)
    assert m["moe_tokens_per_expert"] == {"0": 14.0, "1": 6.0, "2": 6.0, "3": 6.0}


def test_router_jitter_is_refused_by_name(tmp_path):
    from dorarl.errors import UserInputError

    torch.manual_seed(0)
    config = CONFIGS["mixtral"]()
    config.router_jitter_noise = 0.01
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    with pytest.raises(UserInputError, match="router_jitter_noise 0.01"):
        Trainer.from_pretrained(tmp_path, _config())


def test_activation_checkpointing_recomputes_routes_without_counting_them_twice(tmp_path):
    folder = save_moe(tmp_path, "qwen3_moe")
    runs = []
    for checkpointing in (False, True):
        config = _config(aux_loss_coef=0.1, route_replay=True)
        config.activation_checkpointing = checkpointing
        trainer = Trainer.from_pretrained(folder, config)
        groups = engine_groups(trainer)
        _corrupt(groups, every=4, experts=8, top_k=2)  # replayed routes that are not its own
        metrics = trainer.accumulate_gradients(groups)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        runs.append((metrics, grads))
    (plain, plain_grads), (recomputed, recomputed_grads) = runs
    for key in ("moe_tokens_per_expert", "moe_route_mismatch", "moe_routes_compared"):
        assert recomputed[key] == plain[key], key
    assert recomputed["moe_aux_loss"] == pytest.approx(plain["moe_aux_loss"], rel=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, rtol=1e-5, atol=1e-7)
