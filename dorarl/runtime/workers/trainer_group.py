"""The trainer as N ranks in one torch.distributed group (trainer.world_size = N > 1).

The runtime holds one actor, rank 0 (`TrainerGroupWorker`, TrainerWorker's interface); it
starts ranks 1..N-1 as actors it owns (they die with it), hands every rank the batch of a
step through the object store (each trains its own share: dorarl.trainer.sharded) and runs
its own share; the collectives keep the ranks in step. Weights and checkpoints are
gathered and written through rank 0. A rank that dies or raises fails rank 0's call with
one line naming that rank; a death (of any rank) restarts the whole group from the newest
checkpoint and replays the steps since (dorarl.runtime.recovery.trainer_recovery), a rank that
raises stops the run with the resume command.
The sharded trainer and its process group are imported inside the actors, as in
dorarl.runtime.workers.trainer_worker (engines handed rank 0's handle import this module).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from dorarl.data import Group
from dorarl.record.pacing import DeviceModel
from dorarl.runtime.death_cause import death_cause
from dorarl.runtime.threads import apply_threads
from dorarl.runtime.transfer.weight_group import LOOPBACK, alive_nodes, own_host
from dorarl.runtime.workers.trainer_worker import TrainerWorker
from dorarl.trainer.config import TrainerConfig

DEATH_WAIT_S = 30.0  # how long rank 0, its own collective broken, waits to learn which rank died


class RankFailed(RuntimeError):
    """A trainer rank other than 0 died or raised; the message names it."""


class RankDied(RankFailed):
    """A trainer rank other than 0 died: the group is restarted, as a dead rank 0 is
    (dorarl.runtime.recovery.trainer_recovery)."""


def build_rank(model_folder: str, config: TrainerConfig, group, resume_from: str | None):
    """This rank's ShardedTrainer (collective: every rank builds at once) and extra_state."""
    from dorarl.trainer.sharded import ShardedTrainer

    if resume_from:
        return ShardedTrainer.resume(resume_from, config, config.device, group=group)
    return ShardedTrainer.from_pretrained_group(model_folder, config, group, config.device), {}


class TrainerRank:
    """Ranks 1..N-1: a ShardedTrainer that does what rank 0 asks, in rank 0's order."""

    def __init__(
        self, rank: int, world_size: int, addr: str, port: int, config: TrainerConfig, threads: int
    ) -> None:
        from dorarl.trainer.distributed import COLLECTIVE_TIMEOUT, join_group
        from dorarl.trainer.rendezvous import joined_store

        apply_threads(threads)
        self.config = config
        store = joined_store(addr, port, COLLECTIVE_TIMEOUT.total_seconds())
        # its own sockets on its own node's address (rank 0's is where the store is)
        host = own_host(loopback=addr == LOOPBACK)
        self.group = join_group(rank, world_size, store, host, config.device)

    def build(self, model_folder: str, resume_from: str | None) -> None:
        self.trainer, _ = build_rank(model_folder, self.config, self.group, resume_from)

    def train_step(self, groups: list[Group]) -> None:
        self.trainer.train_step(groups)

    def weights(self) -> None:
        self.trainer.named_tensors()

    def adapter_weights(self) -> None:
        self.trainer.adapter_tensors()

    def save_checkpoint(self, folder: str, extra_state: dict[str, Any]) -> None:
        self.trainer.save_checkpoint(Path(folder), extra_state)

    def pid(self) -> int:
        return os.getpid()


class TrainerGroupWorker(TrainerWorker):
    """Rank 0 of the group and the coordinator the runtime talks to; the other ranks ask
    for `rank_resources` (custom Ray resources: the nodes they may run on)."""

    def __init__(
        self,
        model_folder: str,
        config: TrainerConfig,
        threads: int = 1,
        resume_from: str | None = None,
        pace: DeviceModel | None = None,
        rank_resources: dict[str, float] | None = None,
    ) -> None:
        self.rank_resources = dict(rank_resources or {})
        super().__init__(model_folder, config, threads, resume_from, pace)

    def _start(self, resume_from: str | None) -> None:
        world = self.config.world_size
        if not hasattr(self, "ranks"):
            self._spawn_ranks(world)
        refs = [r.build.remote(self.model_folder, resume_from) for r in self.ranks]
        self.trainer, self.extra_state = self._with_ranks(
            refs, lambda: build_rank(self.model_folder, self.config, self.group, resume_from)
        )

    def _spawn_ranks(self, world: int) -> None:
        """Ranks 1..N-1 on free actors, meeting at a store this actor hosts on loopback (one
        node) or on its node's address (several)."""
        from dorarl.trainer.distributed import COLLECTIVE_TIMEOUT, join_group
        from dorarl.trainer.rendezvous import listening_store

        addr = own_host(loopback=alive_nodes() <= 1)
        self._rendezvous, port = listening_store(addr, COLLECTIVE_TIMEOUT.total_seconds())
        per_rank = max(1, self.threads // world)
        apply_threads(per_rank)
        gpus = 1 if torch.device(self.config.device).type == "cuda" else 0
        actor = ray.remote(num_cpus=0, num_gpus=gpus, resources=self.rank_resources)(TrainerRank)
        self.ranks = [
            actor.remote(rank, world, addr, port, self.config, per_rank) for rank in range(1, world)
        ]
        self.group = join_group(0, world, self._rendezvous, addr, self.config.device)

    def rank_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (for the failure tests)."""
        return ray.get([r.pid.remote() for r in self.ranks])

    def _train(self, groups: list[Group]) -> dict[str, Any]:
        batch = ray.put(groups)
        refs = [r.train_step.remote(batch) for r in self.ranks]
        return self._with_ranks(refs, lambda: self.trainer.train_step(groups))

    def weights(self) -> dict[str, torch.Tensor]:
        refs = [r.weights.remote() for r in self.ranks]
        return self._with_ranks(refs, self.trainer.named_tensors)

    def _device_tensors(self) -> dict[str, torch.Tensor]:
        refs = [r.weights.remote() for r in self.ranks]  # the gathers are collective
        return self._with_ranks(refs, lambda: self.trainer.named_tensors(on_device=True))

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        refs = [r.adapter_weights.remote() for r in self.ranks]
        return self._with_ranks(refs, self.trainer.adapter_tensors)

    def _device_adapters(self) -> dict[str, torch.Tensor]:
        refs = [r.adapter_weights.remote() for r in self.ranks]  # the gathers are collective
        return self._with_ranks(refs, lambda: self.trainer.adapter_tensors(on_device=True))

    def _save(self, folder: Path, extra_state: dict[str, Any]) -> Path:
        refs = [r.save_checkpoint.remote(str(folder), extra_state) for r in self.ranks]
        return self._with_ranks(refs, lambda: self.trainer.save_checkpoint(folder, extra_state))

    def _with_ranks(self, refs: list, own):
        """Rank 0's part of a collective call whose other parts are `refs`; a failure of
        another rank is reported as that rank's, even when it broke rank 0's part first."""
        try:
            result = own()
        except Exception as exc:
            self._check_ranks(refs, timeout=DEATH_WAIT_S)
            raise RuntimeError(f"trainer rank 0 of {self.config.world_size}: {exc}") from exc
        self._check_ranks(refs, timeout=None)
        return result

    def _check_ranks(self, refs: list, timeout: float | None) -> None:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for rank, ref in enumerate(refs, start=1):
            if ref not in done:
                continue
            try:
                ray.get(ref)
            except RayActorError as exc:
                raise RankDied(self._name(rank) + f" died: {death_cause(exc)}") from exc
            except RayTaskError as exc:
                cause = exc.cause if exc.cause is not None else exc
                raise RankFailed(
                    self._name(rank) + f" raised {type(cause).__name__}: {cause}"
                ) from exc

    def _name(self, rank: int) -> str:
        return f"trainer rank {rank} of {self.config.world_size}"
