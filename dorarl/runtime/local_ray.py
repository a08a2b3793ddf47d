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

import ray

log = logging.getLogger(__name__)

SINGLE_NODE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


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
    # address="local": always a new cluster of our own, never one named by RAY_ADDRESS, a
    # `ray start` on this host or a stale /tmp/ray/ray_current_cluster
    ray.init(
        address="local",
        num_cpus=num_cpus or os.cpu_count() or 2,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
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


def _single_node_mode() -> None:
    os.environ[SINGLE_NODE_SWITCH] = "0"  # read by every process Ray spawns
    from ray._private import ray_constants  # already imported: its constant is set

    ray_constants.ENABLE_RAY_CLUSTER = False
