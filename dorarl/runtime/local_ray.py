"""Starting Ray on this machine with its services bound to one address (loopback by default).

Ray turns a loopback `_node_ip_address` into the machine's outward address and binds its
gRPC servers there, unless its "no clusters on this OS" switch is set (the one it uses on
macOS and Windows). For a loopback start we set that switch, in this process and for the
processes Ray spawns, so GCS, raylet, object manager and workers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from typing import Any

import ray

from dorarl.errors import UserInputError

log = logging.getLogger(__name__)

SINGLE_NODE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE = "RAY_AUTH_MODE"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start_local_ray(
    num_cpus: int | None = None, host: str = "127.0.0.1", num_gpus: int | None = None
) -> str:
    """`ray.init` of a fresh local instance whose services listen on `host`; returns the
    node address Ray reports (warns if Ray did not keep to a loopback `host`). `num_gpus`
    None lets Ray count the machine's GPUs; a number declares that many."""
    if is_loopback(host):
        _single_node_mode()
    _quiet_auth_notice()
    _quiet_worker_deaths()
    # address="local": always a new cluster of our own, never one named by RAY_ADDRESS, a
    # `ray start` on this host or a stale /tmp/ray/ray_current_cluster
    ray.init(
        address="local",
        num_cpus=num_cpus or os.cpu_count() or 2,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        _node_ip_address=host,
    )
    node = ray.util.get_node_ip_address()
    if is_loopback(host) and not is_loopback(node):
        log.warning(
            "Ray bound its services to %s, not loopback: this Ray version ignores %s; on a "
            "shared host start Ray yourself and pass ray.address",
            node,
            SINGLE_NODE_SWITCH,
        )
    return node


class _DropAuthNotice(logging.Filter):
    """Drops Ray's notice that it turned token auth on for a new local cluster (its default
    since 2.59, and what we want): a warning on every start that asks nothing of the user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def _quiet_auth_notice() -> None:
    # not RAY_AUTH_MODE=token ourselves: Ray reads the mode once, when it is first imported
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropAuthNotice) for f in auth_log.filters):
        auth_log.addFilter(_DropAuthNotice())


WORKER_DIED = "A worker died or was killed"
"""How the raylet's report of a dead worker, published to every driver, begins."""


def _quiet_worker_deaths() -> None:
    """Ray's driver prints the raylet's report of each dead worker (a paragraph on
    possible causes) to stdout whatever `log_to_driver` says; the runtime records each death
    in one line of its own (dorarl.runtime.death_cause), so these reports go to this
    module's logger at debug level instead. Ray's other reports print as before."""
    from ray._private import worker  # its error listener looks the printer up on each report

    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or isinstance(printer, _DeathsToLog):
        return  # a Ray without this private printer: its reports print as they are
    worker.print_to_stdstream = _DeathsToLog(printer)


class _DeathsToLog:
    """Ray's printer of reports, with the raylet's worker-death reports logged instead."""

    def __init__(self, printer: Any) -> None:
        self.printer = printer

    def __call__(self, data: dict[str, Any], ignore_prefix: bool) -> None:
        lines = data.get("lines", [])
        if data.get("pid") == "raylet" and any(WORKER_DIED in str(line) for line in lines):
            for line in lines:
                log.debug("ray: %s", line)
            return
        self.printer(data, ignore_prefix)


def join_ray(address: str) -> None:
    """`ray.init` on an existing cluster (after `check_cluster_auth`); a failure to join is
    one line saying what to check, not Ray's traceback."""
    _quiet_worker_deaths()
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, AuthenticationError...
        ray.shutdown()
        raise UserInputError(f"ray.address={address}: {join_hint(exc)}") from None


def check_cluster_auth(address: str, timeout_s: float = 10.0) -> None:
    """Ask the cluster's GCS for its id, with the token Ray would send (if any): refused for
    want of a token, say so now, in one line, instead of Ray retrying for 20 s. Addresses
    that are not HOST:PORT (auto, ray://) and unreachable ones are left to ray.init."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    token, source = _token_ray_would_send()
    metadata = [("authorization", f"Bearer {token}")] if token else []
    # straight to the address: an http(s)_proxy in the environment must not carry the probe
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                return
            if token:
                raise UserInputError(
                    f"ray.address={address}: the cluster refused the token from {source}; "
                    "use the head node's (`ray get-auth-token` there prints it)"
                ) from None
            raise UserInputError(
                f"ray.address={address}: the cluster uses token authentication; set "
                f"{AUTH_MODE}=token and its token in RAY_AUTH_TOKEN, the file "
                "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (`ray get-auth-token` on the head "
                "node prints it)"
            ) from None


def _token_ray_would_send() -> tuple[str | None, str]:
    """The token and where it comes from, in Ray's order, when RAY_AUTH_MODE=token."""
    if os.environ.get(AUTH_MODE, "").lower() != "token":
        return None, ""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None, str(path)
    except OSError:
        return None, str(path)


def join_hint(exc: BaseException) -> str:
    """What went wrong joining a cluster, and what to set when token auth is the cause."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    text = f"could not join the cluster ({type(exc).__name__}: {first[:200]})"
    auth = "auth" in str(exc).lower() or "token" in str(exc).lower()
    if os.environ.get(AUTH_MODE, "").lower() != "token" or auth:
        text += (
            f"; a cluster with token authentication (Ray >= 2.59 turns it on for `ray start` "
            f"when ~/.ray/auth_token exists) needs {AUTH_MODE}=token set here, and its token in "
            "RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (`ray "
            "get-auth-token` on the head node prints it)"
        )
    return text


def _single_node_mode() -> None:
    os.environ[SINGLE_NODE_SWITCH] = "0"  # read by every process Ray spawns
    from ray._private import ray_constants  # already imported: its constant is set

    ray_constants.ENABLE_RAY_CLUSTER = False
