import pytest

from dorarl.sim.cost import kv_bytes_per_token
from dorarl.simulate.presets import H800, MOE_500B, QWEN25_32B, derive_cost


def qwen_instance(tp=4, trainer=32):
    return derive_cost(
        QWEN25_32B, H800, instance_accelerators=tp, trainer_accelerators=trainer, train_fixed_s=5.0
    )


def test_qwen25_32b_kv_bytes_per_token():
    assert QWEN25_32B.kv_bytes_per_token() == 2 * 64 * 8 * 128 * 2 == 262_144
    assert kv_bytes_per_token(64, 8, 128) == 262_144
    assert qwen_instance().kv_bytes_per_token == 262_144


def test_decode_step_grows_with_context_as_bytes_over_bandwidth():
    cost = qwen_instance()
    bandwidth = 4 * H800.hbm_bytes_per_s * H800.mbu
    extra = 100_000  # resident tokens
    grown = cost.decode_step_s(64, 200_000 + extra) - cost.decode_step_s(64, 200_000)
    assert grown == pytest.approx(extra * 262_144 / bandwidth, rel=1e-9)
    # the weight read: 65 GB over 4 x 3.35 TB/s x 0.6, about 8 ms
    assert cost.decode_fixed_s == pytest.approx(32.5e9 * 2 / bandwidth)
    assert 7e-3 < cost.decode_fixed_s < 9e-3


def test_decode_is_memory_bound_and_weights_dominate_a_small_batch():
    cost = qwen_instance()
    one, sixty_four = cost.decode_step_s(1, 1000), cost.decode_step_s(64, 64_000)
    assert sixty_four < 3 * one  # 64x the work for well under 3x the time


def test_prefill_is_compute_bound_and_scales_with_instance_flops():
    four, eight = qwen_instance(4), qwen_instance(8)
    assert four.prefill_per_token_s == pytest.approx(
        2 * 32.5e9 / (4 * H800.bf16_flops * H800.mfu_prefill)
    )
    assert eight.prefill_per_token_s == pytest.approx(four.prefill_per_token_s / 2)
    # HBM bandwidth plays no part: prefill per token is far below a decode step
    assert four.prefill_per_token_s < four.decode_fixed_s / 100


def test_kv_pool_weights_and_links_follow_the_instance():
    cost = qwen_instance(4)
    pool = 4 * 80e9 * 0.9 - 65e9
    assert cost.kv_capacity_tokens == int(pool / 262_144)
    assert cost.weight_load_s(from_trainer=False) == pytest.approx(0.5 + 65e9 / (4 * 50e9))
    assert cost.migration_s(10_000) == pytest.approx(1e-3 + 10_000 * 262_144 / 200e9)


def test_training_time_per_token_shrinks_with_trainer_accelerators():
    small, large = qwen_instance(trainer=32), qwen_instance(trainer=64)
    assert small.train_per_token_s == pytest.approx(2 * large.train_per_token_s)
    assert small.train_per_token_s == pytest.approx(8 * 32.5e9 / (32 * 989e12 * 0.35))


def test_a_trainer_moved_to_other_devices_shares_its_per_token_work_among_them():
    cost = qwen_instance(trainer=32)
    assert (cost.instance_devices, cost.trainer_devices) == (4, 32)
    half = cost.with_trainer_devices(16)
    assert half.trainer_devices == 16 and half.train_fixed_s == cost.train_fixed_s
    assert half.train_per_token_s == pytest.approx(qwen_instance(trainer=16).train_per_token_s)
    assert half.train_s(1000) - half.train_fixed_s == pytest.approx(
        2 * (cost.train_s(1000) - cost.train_fixed_s)
    )


def test_moe_decode_reads_all_experts_but_computes_active_params():
    cost = derive_cost(
        MOE_500B, H800, instance_accelerators=32, trainer_accelerators=2048, train_fixed_s=1.0
    )
    assert cost.kv_bytes_per_token == 576 * 61 * 2
    assert cost.decode_fixed_s == pytest.approx(500e9 / (32 * 3.35e12 * 0.6))
    assert cost.prefill_per_token_s == pytest.approx(2 * 30e9 / (32 * 989e12 * 0.5))


def test_a_model_that_does_not_fit_is_refused():
    with pytest.raises(AssertionError, match="does not fit"):
        derive_cost(MOE_500B, H800, instance_accelerators=4, trainer_accelerators=8,
                    train_fixed_s=1.0)  # fmt: skip


def test_the_busiest_expert_stretches_only_the_expert_share_of_token_compute():
    from dorarl.simulate.presets import QWEN3_30B_A3B

    args = dict(instance_accelerators=4, trainer_accelerators=32, train_fixed_s=5.0)
    even = derive_cost(QWEN3_30B_A3B, H800, **args)
    skewed = derive_cost(QWEN3_30B_A3B, H800, **args, expert_imbalance=1.5)
    share = 48 * 8 * 3 * 2048 * 768 / 3.3e9
    assert even.expert_share == pytest.approx(share) and 0.5 < share < 0.6
    factor = 1 + share * 0.5
    # the weight read and the KV reads are memory-bound: unchanged
    fixed = even.decode_step_s(0, 50_000)
    assert skewed.decode_step_s(0, 50_000) == pytest.approx(fixed)
    per_seq = even.decode_step_s(64, 50_000) - fixed
    assert skewed.decode_step_s(64, 50_000) - fixed == pytest.approx(per_seq * factor)
    assert skewed.prefill_s(1000) == pytest.approx(even.prefill_s(1000) * factor)
    assert skewed.train_s(10**6) - 5.0 == pytest.approx((even.train_s(10**6) - 5.0) * factor)
    dense = qwen_instance()
    assert dense.expert_share == 0.0 and dense.compute_factor == 1.0
    # 61 GB of weights on 4 x 80 GB at 90%: a KV pool of 2.3M tokens of 98,304 bytes
    assert even.kv_capacity_tokens == int((4 * 80e9 * 0.9 - 61e9) / 98_304)
