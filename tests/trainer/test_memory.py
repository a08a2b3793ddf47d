"""What the trainer's peak memory counts, and that freed tensors leave the process."""

import mmap
import re
import sys
from pathlib import Path

import pytest
import torch

from dorarl.trainer.allocator import map_large_blocks
from dorarl.trainer.memory import PeakMemory

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
MB = 1024**2


def _status_mb(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(field + r":\s+(\d+) kB", text).group(1)) / 1024


@linux_only
def test_shared_pages_resident_before_the_step_are_not_its_memory():
    """Ray's object store pages (weights this actor published) sit in the high-water mark."""
    peak = PeakMemory("cpu")
    if not peak.resettable:
        pytest.skip("this kernel does not let a process reset its RSS high-water mark")
    shared = mmap.mmap(-1, 256 * MB, flags=mmap.MAP_SHARED)
    shared.write(b"x" * (256 * MB))  # resident and counted in RssShmem, like plasma pages
    peak.start()
    step = torch.ones(16 * MB // 4)  # the step's own 16 MB
    got_mb = peak.peak_gb() * 1e9 / MB
    assert got_mb < _status_mb("VmRSS") - 200, "the shared pages were counted"
    assert got_mb >= 16
    del step
    shared.close()


@linux_only
def test_freed_tensors_between_live_ones_go_back_to_the_os():
    """The pattern of a training step: activations freed between long-lived tensors."""
    if not map_large_blocks():
        pytest.skip("not glibc")
    torch.empty(16 * MB // 4).fill_(1)  # freed: raises glibc's dynamic threshold to 16 MB
    before = _status_mb("RssAnon")
    activations, keepers = [], []
    for _ in range(64):
        activations.append(torch.ones(2 * MB // 4))
        keepers.append(torch.ones(64))
    grown = _status_mb("RssAnon")
    activations.clear()
    assert grown - before > 100
    assert _status_mb("RssAnon") - before < 30, "freed activations stayed resident"
    del keepers
