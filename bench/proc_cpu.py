"""CPU seconds of a process tree, by process (and the tree itself, `descendants`).

`python -m bench.proc_cpu PID [--out FILE]` writes {name: user+system seconds} for PID and every descendant (named by
its --worker-id, its `services.X` module (routers summed), or its executable), for per-process CPU per output token
(before/after snapshots of one load run)."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user+system seconds) from /proc/PID/stat."""
    try:
        raw = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _name(pid: int) -> str:
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    line = " ".join(argv)
    if found := re.search(r"--worker-id (\S+)", line):
        return found.group(1)
    if found := re.search(r"-m (services\.\w+|bench\.\w+)", line):
        return found.group(1).split(".")[1]
    if "EngineCore" in line or "VLLM" in line:
        return "vllm-engine-core"
    if "spawn_main" in line:
        return "engine-core"  # a worker's engine core (services/worker/core.py), summed over workers
    if "resource_tracker" in line:
        return "mp-resource-tracker"
    return os.path.basename(argv[0]).split()[0] if argv[0].strip() else str(pid)


def _processes() -> dict[int, tuple[int, float]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := _stat(int(entry))) is not None:
            out[int(entry)] = s
    return out


def descendants(root: int, procs: dict | None = None) -> set[int]:
    """root and every process below it."""
    parents = {pid: s[0] for pid, s in (procs or _processes()).items()}
    members, grew = {root}, True
    while grew:
        new = {p for p, parent in parents.items() if parent in members} - members
        members |= new
        grew = bool(new)
    return members


def tree_cpu(root: int) -> dict[str, float]:
    procs = _processes()
    cpu = {pid: s[1] for pid, s in procs.items()}
    out: dict[str, float] = defaultdict(float)
    for pid in descendants(root, procs):
        if pid in cpu:
            out[_name(pid)] += cpu[pid]
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("pid", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    text = json.dumps(tree_cpu(args.pid), indent=1, sort_keys=True)
    if args.out:
        open(args.out, "w").write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
