"""This host's identity: services on the same host share memory (the kvstore's arena) instead of sockets.

hostname and the kernel's boot id: two containers of one pod share both only when they can share
/dev/shm as well (the deployment mounts it); MESHSERVE_HOST_ID overrides it (tests, or an operator who
knows better).
"""

from __future__ import annotations

import os
import socket
from functools import cache
from pathlib import Path


@cache
def host_id() -> str:
    if os.environ.get("MESHSERVE_HOST_ID"):
        return os.environ["MESHSERVE_HOST_ID"]
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}:{boot}"
