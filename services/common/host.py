"""This host's identity and place: services on the same host share memory (the kvstore's arena) instead of
sockets, and close ones are preferred to far ones.

host_id(): hostname and the kernel's boot id: two containers of one pod share both only when they can share
/dev/shm as well (the deployment mounts it); MESHSERVE_HOST_ID overrides it (tests, or an operator who
knows better).

topology(): where the process runs as a path "rack/node/domain" (the autoscaler's placement uses the same
levels: a domain is an NVLink island or a NUMA domain within a node). MESHSERVE_TOPOLOGY sets it (a
deployment sets it per node pool or zone; a mesh on one machine may give workers different NUMA domains);
by default the node is this host and the rack and domain are unknown (""). distance() ranks two paths.
"""

from __future__ import annotations

import socket
from functools import cache
from pathlib import Path

from services.common import envs


@cache
def host_id() -> str:
    if given := envs.HOST_ID.get():
        return given
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}:{boot}"


FAR = 3  # distance between places in different racks, or where either is unknown


def topology() -> str:
    """This process's "rack/node/domain" (MESHSERVE_TOPOLOGY, else "/<host id>/"); ValueError naming the
    variable when it is not three levels."""
    value = envs.TOPOLOGY.get()
    if value is None:
        return f"/{host_id()}/"
    if value.count("/") != 2 or not value.split("/")[1]:
        raise ValueError(f"{envs.TOPOLOGY.name}={value!r}: expected rack/node/domain (the node not empty), "
                         f"e.g. rack-1/node-7/numa0")
    return value


def distance(a: str, b: str) -> int:
    """0 same domain, 1 same node, 2 same rack, FAR otherwise (or when either place is unknown: "", or not a
    rack/node/domain path: a heartbeat is outside input)."""
    pa, pb = a.split("/"), b.split("/")
    if len(pa) != 3 or len(pb) != 3:
        return FAR
    (ra, na, da), (rb, nb, db) = pa, pb
    if ra != rb:
        return FAR
    if na != nb:
        return 2
    return 0 if da == db else 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at this moment (the OS's pick; another process may still take it before its user
    binds it: callers that start services retry, see services.mesh.launcher)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
