"""Where replicas go: a pure policy (no I/O). The mesh's launcher asks it for every worker it starts on a mesh of
several hosts (services/mesh/launcher.py: MeshSpec.hosts), whether `meshserve up`, the Supervisor's Scale (the
autoscaler's local actuator) or a supervisor restart asked for the worker.

A host has cores (or devices); a replica is one tensor-parallel group (services/engine/parallel.py): `size` cores
(ranks x threads per rank), all on one host: its ranks share memory (the KV pool, the all-reduce), so a group is
never split. place() puts n groups of one pool, each on the host that is, in order:
1. able to take it whole: free cores >= size;
2. beside its partner: a host already running a group of the partner role (decode for a prefill group, prefill for
   a decode group) where KV moves between workers by shared memory (Host.shm_kv), so the handoff never crosses the
   network; else a host in a rack (Host.rack, when named) that holds less of this role than its share of the partner
   role's devices, so the handoffs can stay under the rack's switch (at 1,000 hosts in racks of 40, best fit alone
   sent 12-16% of KV bytes across racks: docs/CLUSTER.md, placement);
3. packed: a host already in use before an empty one, and then the one left with the fewest free cores (best fit),
   so whole hosts stay free for large groups (and can be given back when the mesh scales down);
4. first by name (deterministic).
Groups that fit nowhere are reported as unplaced, never split.

Each pass keeps the hosts in six sorted lists ((partner here? a rack that wants the role?) x (in use?), by free
cores), re-sorted when a rack's wish changes, so a group is placed
by a binary search: 10,000 devices in 300-odd hosts of mixed sizes are filled with 2,000-odd groups in well under a
second (tests/unit/test_autoscaler_placement.py).

The router's topology context comes from the same Host data: a worker the launcher starts on a host reports
Host.topology ("rack/host/") as its place (MESHSERVE_TOPOLOGY), which the router's tie-break between decode workers
ranks by services.common.host.distance.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

PARTNER = {"prefill": "decode", "decode": "prefill"}  # unified workers have none


@dataclass(frozen=True)
class Host:
    """A host groups may be placed on: its cores and rack, whether KV moves between its workers through shared
    memory, and, for the workers `meshserve up` starts on it (the mesh file's `mesh.hosts`), the address they bind
    and advertise and the network namespace they run in ("" = this machine's own network: its workers keep this
    machine's host identity, so the kvstore serves their KV through shared memory)."""

    name: str
    cores: int  # cores (or devices) its groups may use
    rack: str = ""
    shm_kv: bool | None = None  # KV moves between workers on this host through shared memory (default: unless netns)
    address: str = "127.0.0.1"
    netns: str = ""

    def __post_init__(self):
        if self.shm_kv is None:  # the kvstore runs on this machine: only its own network's workers share memory
            object.__setattr__(self, "shm_kv", not self.netns)

    @property
    def topology(self) -> str:
        """Its place as the "rack/node/domain" path its workers report (MESHSERVE_TOPOLOGY)."""
        return f"{self.rack}/{self.name}/"


@dataclass(frozen=True)
class Group:
    """A placed replica: one worker and its tensor-parallel ranks."""

    pool: str
    role: str  # prefill | decode | unified
    host: str
    size: int  # cores


@dataclass
class Placement:
    groups: list  # Group, placed now
    unplaced: int  # groups that fit on no host


def free_cores(hosts: list[Host], placed: list[Group]) -> dict[str, int]:
    """Host name -> cores not taken by placed groups (ValueError for a group on an unknown host)."""
    free = {h.name: h.cores for h in hosts}
    for g in placed:
        if g.host not in free:
            raise ValueError(f"group of pool {g.pool!r} is on unknown host {g.host!r}")
        free[g.host] -= g.size
    return free


def place(hosts: list[Host], placed: list[Group], pool: str, role: str, size: int, n: int) -> Placement:
    """n groups of `size` cores for `pool` (workers of `role`) beside the groups already placed (module doc)."""
    if size < 1 or n < 0:
        raise ValueError(f"group size must be >= 1 and count >= 0, got size={size} n={n}")
    if len({h.name for h in hosts}) != len(hosts):
        raise ValueError("host names must be unique")
    free = free_cores(hosts, placed)
    used = Counter(g.host for g in placed)
    partner = PARTNER.get(role)
    paired = {g.host for g in placed if g.role == partner}
    shm = {h.name for h in hosts if h.shm_kv}
    rack = {h.name: h.rack for h in hosts}
    mine, theirs = Counter(), Counter()  # devices by (named) rack: of this role, of its partner role
    for g in placed:
        if rack[g.host] and g.role in (role, partner):
            (mine if g.role == role else theirs)[rack[g.host]] += g.size

    def wanting() -> frozenset:
        """Racks that hold less of this role's devices than their share of the partner's: where the next group's KV
        handoffs can stay under the rack's switch."""
        m, t = sum(mine.values()), sum(theirs.values())
        return frozenset(r for r, n in theirs.items() if mine[r] * t < n * m or not m)

    def klass(name: str) -> int:
        near = 0 if name in paired and name in shm else 2 if rack[name] in wants else 4
        return near + (0 if used[name] else 1)

    def classes_now() -> list:
        """Preference classes, best first: (beside a partner, in use), (beside, empty), (a rack that wants the role,
        in use) ... (elsewhere, empty); each sorted by (free, name)."""
        out = [[] for _ in range(6)]
        for h in hosts:
            if free[h.name] >= size:
                out[klass(h.name)].append((free[h.name], h.name))
        for c in out:
            c.sort()
        return out

    wants = wanting() if partner else frozenset()
    classes = classes_now()
    groups = []
    while len(groups) < n:
        best = None
        for c in classes:
            i = bisect.bisect_left(c, (size, ""))
            if i < len(c):
                best = (c, i)
                break
        if best is None:
            break
        c, i = best
        cores, name = c.pop(i)
        groups.append(Group(pool, role, name, size))
        used[name] += 1
        free[name] = cores - size
        if rack[name] and partner:
            mine[rack[name]] += size
            now = wanting()
            if now != wants:  # a rack's share moved past its partner's: re-sort the hosts by the new classes
                wants = now
                classes = classes_now()
                continue
        if free[name] >= size:
            bisect.insort(classes[klass(name)], (free[name], name))
    return Placement(groups, n - len(groups))
