"""Where a process group meets: a TCPStore that listens on one address, and gloo's and
NCCL's own sockets bound to the interface of that address.

torch's TCPStore listens on every interface whatever host name it is given, and gloo's
default device binds the address the machine's host name resolves to. A local run binds
them to loopback, a run on several nodes to the node's own address, never to all interfaces.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist

INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def listening_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """The hosting end of a store on a free port of `host` only (returns at once; members
    join later with `joined_store`)."""
    listener = socket.socket(_family(host), socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(socket.SOMAXCONN)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        None,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns the socket from here
    )
    return store, port


def joined_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A member's end of the store hosted at host:port."""
    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


def bind_collectives_to(host: str) -> None:
    """Make this process's gloo and NCCL sockets use the interface that holds `host`, unless
    the user chose one (the variables are read when a group is made)."""
    name = interface_of(host)
    for variable in INTERFACE_VARIABLES:
        if name is not None and not os.environ.get(variable):
            os.environ[variable] = name


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds address `host` (None: none does)."""
    import psutil

    try:
        wanted = ipaddress.ip_address(host)
    except ValueError:  # a host name
        wanted = ipaddress.ip_address(socket.gethostbyname(host))
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(address.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name: IPv4, as the store's clients resolve it
        return socket.AF_INET
