"""A local run listens on loopback only (services bind to loopback unless the user says
otherwise): Ray's services and the process groups' stores and sockets."""

import ipaddress
import logging

import psutil
import pytest
import ray

from dorarl.errors import UserInputError
from dorarl.runtime.local_ray import (
    _quiet_worker_deaths,
    check_cluster_auth,
    is_loopback,
    join_hint,
    start_local_ray,
)


def _listening(processes: list[psutil.Process]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket that `processes` listen on."""
    found = set()
    for process in processes:
        try:
            connections = process.net_connections(kind="tcp")
        except psutil.Error:  # gone since it was listed
            continue
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN:
                addr = ipaddress.ip_address(conn.laddr.ip.split("%")[0])
                if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                    addr = addr.ipv4_mapped
                found.add((str(addr), conn.laddr.port))
    return found


def _this_run() -> list[psutil.Process]:
    """This process and every process it started (Ray's services, its workers and their
    children): the run's own sockets, whatever else the machine runs."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def test_loopback_names():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert not is_loopback("head-node")


@pytest.mark.slow
def test_a_local_run_listens_on_loopback_only(capfd, monkeypatch):
    """Ray's services, the weight-transfer group's store and gloo pairs, and a sharded
    trainer's group (its store and gloo pairs): every socket the run's processes listen on
    is on loopback."""
    try:
        node = start_local_ray(num_cpus=2)
        groups = _form_the_runs_groups()
        opened = _listening(_this_run())
        _joining_checks_the_token(ray.get_runtime_context().gcs_address, monkeypatch)
        del groups
    finally:
        ray.shutdown()
    assert node == "127.0.0.1"
    assert len(opened) >= 4, f"too few sockets to be the run's: {opened}"
    exposed = sorted(a for a in opened if not is_loopback(a[0]))
    assert not exposed, f"the run listens beyond loopback: {exposed}"
    # Ray's notice that it turned token auth on (its default) stays off the screen
    assert "Token authentication is enabled" not in capfd.readouterr().err


def _form_the_runs_groups() -> list:
    """Two actors forming the weight-transfer group (rank 0 hosting its store, as the
    trainer does) and a two-rank trainer group, as the runtime forms them; returns the
    actors, which keep their groups until they die."""

    @ray.remote(num_cpus=0)
    class Member:
        def host_weights(self) -> tuple[str, int]:
            from dorarl.runtime.transfer.weight_group import open_store, own_host

            self.store, port = open_store(own_host(loopback=True), 30.0)
            return "127.0.0.1", port

        def join_weights(self, address, rank: int) -> int:
            import torch

            from dorarl.runtime.transfer.weight_group import WeightGroup

            store = self.store if rank == 0 else None
            self.weights = WeightGroup(address, rank, torch.device("cpu"), store)
            return rank

        def host_trainer_group(self) -> int:
            from dorarl.trainer.rendezvous import listening_store

            self.rendezvous, port = listening_store("127.0.0.1", 30.0)
            return port

        def join_trainer_group(self, rank: int, port: int) -> int:
            from dorarl.trainer.distributed import join_group
            from dorarl.trainer.rendezvous import joined_store

            store = self.rendezvous if rank == 0 else joined_store("127.0.0.1", port, 30.0)
            self.group = join_group(rank, 2, store, "127.0.0.1", "cpu")
            return rank

    from dorarl.runtime.transfer.weight_group import GroupAddress

    members = [Member.remote(), Member.remote()]
    host, port = ray.get(members[0].host_weights.remote())
    address = GroupAddress(host, port, 2, "gloo", 30.0)
    joins = [m.join_weights.remote(address, rank) for rank, m in enumerate(members)]
    assert ray.get(joins, timeout=60) == [0, 1]
    port = ray.get(members[0].host_trainer_group.remote())
    joins = [m.join_trainer_group.remote(rank, port) for rank, m in enumerate(members)]
    assert ray.get(joins, timeout=60) == [0, 1]
    return members


def _joining_checks_the_token(address: str, monkeypatch) -> None:
    """The local Ray uses token auth (Ray's default): joining it without the token, or with
    a wrong one, is one clear error at once; with the token it passes."""
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    check_cluster_auth(address)  # the token Ray made for it, in ~/.ray/auth_token
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-token")
    with pytest.raises(UserInputError, match="refused the token from RAY_AUTH_TOKEN"):
        check_cluster_auth(address)
    monkeypatch.delenv("RAY_AUTH_MODE")
    with pytest.raises(UserInputError, match="uses token authentication; set RAY_AUTH_MODE"):
        check_cluster_auth(address)


def test_a_failed_join_says_how_to_use_token_auth(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    hint = join_hint(ConnectionError("Failed to connect to GCS at 10.1.2.3:6379\nretrying"))
    assert "\n" not in hint and "ConnectionError: Failed to connect to GCS" in hint
    assert "RAY_AUTH_MODE=token" in hint and "RAY_AUTH_TOKEN_PATH" in hint
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert "RAY_AUTH_MODE" not in join_hint(ConnectionError("no route to host"))
    assert "RAY_AUTH_MODE=token" in join_hint(RuntimeError("Invalid authentication token"))


def test_the_raylets_report_of_a_dead_worker_is_logged_not_printed(capsys, caplog):
    """Ray's driver prints the raylet's reports whatever log_to_driver says (the text is
    the one Ray 2.60 printed for an actor killed with SIGKILL, cut)."""
    from ray._private import worker

    monkey = pytest.MonkeyPatch()
    monkey.setattr(worker, "print_to_stdstream", worker.print_to_stdstream)  # undone below
    try:
        _quiet_worker_deaths()
        _quiet_worker_deaths()  # once is enough: a second start wraps nothing again
        died = ("A worker died or was killed while executing a task by an unexpected system "
                "error. To troubleshoot the problem, check the logs for the dead worker.")  # fmt: skip
        with caplog.at_level(logging.DEBUG, logger="dorarl.runtime.local_ray"):
            worker.print_to_stdstream({"lines": [died], "pid": "raylet", "is_err": False}, False)
        other = {"lines": ["some other report"], "pid": "raylet", "is_err": False}
        worker.print_to_stdstream(other, False)
    finally:
        monkey.undo()
    out = capsys.readouterr().out
    assert "A worker died" not in out and "some other report" in out
    assert any("A worker died" in r.getMessage() for r in caplog.records)
