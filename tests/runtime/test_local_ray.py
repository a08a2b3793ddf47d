"""A local Ray started by dorarl listens on loopback only (README, Security: services bind
to loopback unless the user says otherwise)."""

import ipaddress
from pathlib import Path

import pytest
import ray

from dorarl.errors import UserInputError
from dorarl.runtime.local_ray import check_cluster_auth, is_loopback, join_hint, start_local_ray

LISTEN = "0A"  # TCP state code in /proc/net/tcp*


def _listening() -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket on this machine, from /proc."""
    found = set()
    for name, width in (("tcp", 4), ("tcp6", 16)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc stores each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            addr = ipaddress.ip_address(words)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            found.add((str(addr), int(hex_port, 16)))
    return found


def test_loopback_names():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert not is_loopback("head-node")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_local_ray_listens_on_loopback_only(capfd, monkeypatch):
    before = _listening()
    try:
        node = start_local_ray(num_cpus=1)
        opened = _listening() - before

        @ray.remote
        def ping() -> int:
            return 1

        assert ray.get(ping.remote()) == 1  # workers reach the services over loopback
        _joining_checks_the_token(ray.get_runtime_context().gcs_address, monkeypatch)
    finally:
        ray.shutdown()
    assert node == "127.0.0.1"
    assert opened, "Ray opened no listening socket?"
    exposed = sorted(a for a in opened if not is_loopback(a[0]))
    assert not exposed, f"Ray listens beyond loopback: {exposed}"
    # Ray's notice that it turned token auth on (its default) stays off the screen
    assert "Token authentication is enabled" not in capfd.readouterr().err


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
