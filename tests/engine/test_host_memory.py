"""The host memory a process may use: the machine's, or its cgroup's limit when lower, with
what is free within that limit."""

import dorarl.engine.host_memory as host_module
from dorarl.engine.host_memory import host_memory

GB = 1 << 30


class _Machine:
    total, available = 64 * GB, 40 * GB


def test_a_cgroup_limit_below_the_machine_bounds_both(monkeypatch):
    monkeypatch.setattr(host_module.psutil, "virtual_memory", lambda: _Machine())
    monkeypatch.setattr(host_module, "cgroup_memory", lambda: (6 * GB, 8 * GB))
    assert host_memory() == (2 * GB, 8 * GB)


def test_without_a_limit_the_machine_counts(monkeypatch):
    monkeypatch.setattr(host_module.psutil, "virtual_memory", lambda: _Machine())
    monkeypatch.setattr(host_module, "cgroup_memory", lambda: None)
    assert host_memory() == (40 * GB, 64 * GB)
    monkeypatch.setattr(host_module, "cgroup_memory", lambda: (1 * GB, 128 * GB))
    assert host_memory() == (40 * GB, 64 * GB)  # a limit above the machine changes nothing


def test_a_limit_file_reads_max_as_none(tmp_path):
    (tmp_path / "max").write_text("max\n")
    (tmp_path / "n").write_text("1234\n")
    assert host_module._read_int(str(tmp_path / "max")) is None
    assert host_module._read_int(str(tmp_path / "n")) == 1234
    assert host_module._read_int(str(tmp_path / "absent")) is None
