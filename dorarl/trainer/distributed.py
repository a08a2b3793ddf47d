"""The process group of a sharded trainer: joining it, FSDP2 wrapping, the step's split.

Invariants: every rank runs the same number of forward/backward passes per step (FSDP's
all-gathers and reduce-scatters must pair up), and gradients are SUMMED over ranks (the
per-token weights are already normalised over the whole batch, so the sum of every
rank's micro-batch losses is the single-process loss and its gradient).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dorarl.trainer.batch import plan_micro_batches

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the trainer group."""

    rank: int
    world_size: int
    mesh: DeviceMesh

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def join_group(rank: int, world_size: int, addr: str, port: int, device: str) -> RankGroup:
    """Join the group rendezvousing at addr:port (rank 0 hosts the store): gloo on the CPU,
    NCCL on cuda; a one-dimensional device mesh over every rank."""
    device_type = torch.device(device).type
    if device_type == "cuda":
        torch.cuda.set_device(torch.cuda.current_device())
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return RankGroup(rank, world_size, init_device_mesh(device_type, (world_size,)))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy:
    """bf16 parameters and compute with fp32 gradient reduction on cuda (the master weights
    and AdamW state stay in the loaded dtype); plain fp32 on the CPU."""
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(root: torch.nn.Module, layers: list[torch.nn.Module], group: RankGroup) -> None:
    """fully_shard each decoder layer, then the root (embeddings, final norm, output layer,
    tied or not); gradients are summed, not averaged, over ranks."""
    policy = mixed_precision(torch.device(group.mesh.device_type))
    for layer in layers:
        fully_shard(layer, mesh=group.mesh, mp_policy=policy)
    fully_shard(root, mesh=group.mesh, mp_policy=policy)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def rank_shares(lengths: list[int], world_size: int, token_budget: int) -> list[list[list[int]]]:
    """Each rank's micro-batches (indices into `lengths`): sequences dealt longest first to
    the rank with the fewest tokens so far, then packed per rank within `token_budget` as
    a single process packs them. Deterministic, so every rank computes the same split."""
    members: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        members[rank].append(i)
        loads[rank] += lengths[i]
    return [
        [
            [mine[j] for j in batch]
            for batch in plan_micro_batches([lengths[i] for i in mine], token_budget)
        ]
        for mine in members
    ]


def reduce_over_ranks(values: list[float], group: RankGroup, op: str = "sum") -> list[float]:
    """Element-wise sum (or max) of `values` over the ranks, in float64."""
    device = group.mesh.device_type
    reduced = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return reduced.tolist()
