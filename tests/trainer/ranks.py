"""Run a function on N local trainer ranks (torch.multiprocessing, gloo): the Ray-free
harness of the sharded-trainer tests. Rank 0's return value comes back; the ranks meet at a
store this process hosts."""

from __future__ import annotations

import faulthandler
import pickle
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dorarl.trainer.distributed import join_group, leave_group
from dorarl.trainer.rendezvous import joined_store, listening_store

HOST = "127.0.0.1"


def _rank_main(rank: int, world_size: int, port: int, fn, args, out: str) -> None:
    faulthandler.enable(all_threads=True)  # a rank that dies of a signal says where
    torch.set_num_threads(1)
    group = join_group(rank, world_size, joined_store(HOST, port, 300.0), HOST, "cpu")
    try:
        result = fn(group, *args)
    finally:
        leave_group()
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(result))


def run_ranks(fn, world_size: int, *args):
    """`fn(group, *args)` on every rank; returns rank 0's result (test data, our own)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pickle")
        _store, port = listening_store(HOST, 300.0)  # the ranks meet here, at this process
        mp.start_processes(
            _rank_main,
            args=(world_size, port, fn, args, out),
            nprocs=world_size,
            start_method="spawn",
        )
        return pickle.loads(Path(out).read_bytes())  # written by our own rank 0 above
