"""Two engine actors on one GPU (half of it each): a migration's KV goes device to device
through CUDA IPC, the request continuing as it would have unmoved. Needs a GPU and Ray
(`scripts/gpu_check_2.sh` runs it; scripts/gpu_prepare.sh carries Ray's wheel)."""

import pytest
import ray
import torch

from dorarl.engine import EngineConfig, SamplingParams
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.transfer.weight_endpoints import WEIGHTS_GROUP
from dorarl.runtime.transfer.weight_group import GroupAddress, open_store
from dorarl.runtime.workers.engine_worker import EngineWorker, NewRequest

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


def _alone(actor, rid: str, prompt: list[int], params: SamplingParams, steps: int = 1 << 20):
    ray.get(actor.add.remote([NewRequest(rid, prompt, params)]))
    return ray.get(actor.run.remote(steps, steps != 1 << 20)).finished


def test_a_migration_between_two_actors_on_one_gpu_goes_through_cuda_ipc(tiny_model_dir):
    start_local_ray(num_cpus=2, num_gpus=1)
    try:
        config = EngineConfig(device="cuda", max_num_seqs=2, max_model_len=128, dtype="float32")
        remote = ray.remote(num_cpus=0, num_gpus=0.5, concurrency_groups={WEIGHTS_GROUP: 1})
        src, dst = (remote(EngineWorker).remote(i, str(tiny_model_dir), config) for i in (0, 1))
        store, port = open_store("127.0.0.1", 60.0)
        address = GroupAddress("127.0.0.1", port, 2, "nccl", 60.0)
        members = ray.get([a.join_weights.remote(address, r) for r, a in enumerate((src, dst))])
        assert members[0].device_key == members[1].device_key  # one GPU: IPC, not NCCL
        params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=24,
                                stop_token_ids=[], seed=3)  # fmt: skip
        prompt = [(11 * i + 2) % 100 for i in range(21)]
        (want,) = _alone(dst, "unmoved", prompt, params)
        assert _alone(src, "moved", prompt, params, steps=8) == []
        ids, parcel = src.export_kv.options(num_returns=2).remote(["moved"])
        assert ray.get(dst.import_parcel.remote(parcel, src, 0, "ipc")) == ["moved"]
        assert ray.get(parcel).snapshots[0].kv is None
        (got,) = ray.get(dst.run.remote(1 << 20)).finished
        assert got.output_ids == want.output_ids and got.migrations == 1
        assert ray.get(src.held_tickets.remote()) == 0  # released once copied
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                   atol=1e-5, rtol=0)  # fmt: skip
        del store
    finally:
        ray.shutdown()
