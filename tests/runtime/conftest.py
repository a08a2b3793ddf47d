"""Fixtures of the runtime tests."""

import threading

import pytest
import torch

from dorarl.runtime.transfer.weight_group import GroupAddress, WeightGroup, open_store


@pytest.fixture(scope="module")
def pair():
    """Ranks 0 and 1 of one group, formed once for every test here (as the runtime does)."""
    store, port = open_store("127.0.0.1", 30.0)
    address = GroupAddress("127.0.0.1", port, 2, "gloo", 30.0)
    groups: dict[int, WeightGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = WeightGroup(address, rank, torch.device("cpu"), store if rank == 0 else None)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return groups[0], groups[1]
