"""Processes a test started, found by their parent (fault tests signal only their own pids)."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """The processes whose parent is pid (a worker's engine core, a core's tensor-parallel ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def processes_in(folder) -> list:
    """PIDs whose working directory is folder (every service `up` starts inherits it)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd") == str(folder):
                    out.append(int(entry))
            except OSError:
                pass
    return out
