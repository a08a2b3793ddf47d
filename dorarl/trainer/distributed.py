"""The process group of a sharded trainer: joining it, FSDP2 wrapping, the step's split.

Invariants: every rank runs the same number of forward/backward passes per step (FSDP's
all-gathers and reduce-scatters must pair up), and gradients are SUMMED over ranks (the
per-token weights are already normalised over the whole batch, so the sum of every
rank's micro-batch losses is the single-process loss and its gradient). Every sequence goes
to exactly one rank; packed, a group's sequences share a rank (and its rows' prompt) unless
the group is longer than the widest row.
"""

from __future__ import annotations

import datetime
import gc
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dorarl.trainer.batch import TrainSequence
from dorarl.trainer.packing import MAX_ROW_TOKENS, Packing, shared_prompt_segments
from dorarl.trainer.rendezvous import bind_collectives_to

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


def join_group(rank: int, world_size: int, store: dist.Store, host: str, device: str) -> RankGroup:
    """Join the group that meets at `store` (`rendezvous.listening_store` on `host`, one
    process's; the others' `joined_store`): gloo on the CPU, NCCL on cuda, their sockets on
    `host`'s interface; a one-dimensional device mesh over every rank."""
    device_type = torch.device(device).type
    if device_type == "cuda":
        torch.cuda.set_device(torch.cuda.current_device())
    bind_collectives_to(host)
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return RankGroup(rank, world_size, init_device_mesh(device_type, (world_size,)))


def leave_group() -> None:
    """Leave the group while Python is whole: FSDP-wrapped models are cyclic garbage that
    hold the group and its last gloo works, whose tensors a gloo thread releases; left to
    the interpreter's exit, that thread needs the GIL as Python finalizes, is made to exit
    inside a C++ destructor and aborts the process ("terminate called without an active
    exception"). Collected first, the group's threads end before the process does."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


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


def rank_shares(
    seqs: list[TrainSequence], world_size: int, packing: Packing, token_budget: int
) -> list[list[TrainSequence]]:
    """Each rank's sequences (each rank then plans its micro-batches as one process does).

    Units are dealt longest first to the rank with the fewest tokens so far. Padded, a unit
    is one sequence. Packed, it is one group (a prompt with its responses, as a packed row
    holds them); a group longer than the widest packed row is dealt as the row-sized parts
    it is split into anyway, so the split repeats no prompt that one process's widest rows
    would not. Deterministic, so every rank computes the same split.
    """
    units = _units(seqs, packing, token_budget)
    members = _deal([length for length, _ in units], world_size)
    return [[seq for i in sorted(mine) for seq in units[i][1]] for mine in members]


def _units(
    seqs: list[TrainSequence], packing: Packing, token_budget: int
) -> list[tuple[int, list[TrainSequence]]]:
    """(tokens, sequences) of each indivisible part of the batch."""
    if packing == "padded":
        return [(seq.length, [seq]) for seq in seqs]
    width = min(token_budget, MAX_ROW_TOKENS)
    return [(part.length, part.responses) for part in shared_prompt_segments(seqs, width)]


def _deal(costs: list[int], world_size: int) -> list[list[int]]:
    """Indices into `costs`, longest first to the least-loaded rank (ties: lower index)."""
    members: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        members[rank].append(i)
        loads[rank] += costs[i]
    return members


def reduce_over_ranks(values: list[float], group: RankGroup, op: str = "sum") -> list[float]:
    """Element-wise sum (or max) of `values` over the ranks, in float64."""
    device = group.mesh.device_type
    reduced = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return reduced.tolist()


def gather_over_ranks(rows: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """Every rank's `rows` (any number each, the same trailing shape and dtype), concatenated
    in rank order on every rank."""
    device = group.mesh.device_type
    rows = rows.to(device)
    count = torch.tensor([rows.shape[0]], dtype=torch.long, device=device)
    counts = [torch.zeros_like(count) for _ in range(group.world_size)]
    dist.all_gather(counts, count)
    longest = max(int(c) for c in counts)
    padded = torch.zeros((longest, *rows.shape[1:]), dtype=rows.dtype, device=device)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(group.world_size)]
    dist.all_gather(parts, padded)  # equal shapes: padded to the longest rank's
    return torch.cat([part[: int(c)] for part, c in zip(parts, counts, strict=True)])
