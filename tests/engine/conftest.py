"""Engine tests run single-threaded: tiny models are fastest on one thread, and OpenMP
spin-waits badly when the CPU is shared with other processes."""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
