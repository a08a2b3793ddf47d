"""What the trainer's peak memory counts, and that freed tensors leave the process."""

import mmap
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


FREED_BETWEEN_LIVE_ONES = """
import re, sys
from pathlib import Path
import torch
from dorarl.trainer.allocator import map_large_blocks

def rss_anon_mb():
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"RssAnon:\\s+(\\d+) kB", text).group(1)) / 1024

if not map_large_blocks():
    sys.exit(3)
MB = 1024**2
torch.empty(16 * MB // 4).fill_(1)  # freed: raises glibc's dynamic threshold to 16 MB
before = rss_anon_mb()
activations, keepers = [], []
for _ in range(64):
    activations.append(torch.ones(2 * MB // 4))
    keepers.append(torch.ones(64))
grown = rss_anon_mb()
activations.clear()
print(grown - before, rss_anon_mb() - before)
"""


@linux_only
def test_freed_tensors_between_live_ones_go_back_to_the_os():
    """The pattern of a training step: activations freed between long-lived tensors. In a
    fresh process: in the test process, threads left by earlier tests (Ray's, a worker's)
    allocate and free beside the measurement."""
    run = subprocess.run(
        [sys.executable, "-c", FREED_BETWEEN_LIVE_ONES], capture_output=True, text=True
    )
    if run.returncode == 3:
        pytest.skip("not glibc")
    assert run.returncode == 0, run.stderr
    grown_mb, left_mb = map(float, run.stdout.split())
    assert grown_mb > 100, "the activations never became resident"
    assert left_mb < 30, "freed activations stayed resident"
