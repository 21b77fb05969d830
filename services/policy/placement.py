"""Replica placement under topology constraints: a pure policy (no I/O). Not called by the running mesh yet (it
has no tensor-parallel groups to place; issue 40 wires it in with them, or replaces it): tested on its own.

The inventory is a set of devices, each in a topology path rack / node (host) / domain (an NVLink island
or a NUMA domain within the node). A replica of a pool is a tensor-parallel group of k devices that must
share one domain; it is placed, upgraded and removed as a unit.

place(inventory, used, pool, k, n) places n replicas of size k:
- stranded devices: free devices left in a domain with fewer than k free (no further replica of this size
  fits there). A domain that can take q = free // k replicas strands nothing while it takes at most q - 1 of
  them; taking all q strands free % k. So the replicas go first where they strand nothing, and only beyond
  that capacity fill domains completely, those with the smallest remainder first: optimal for one size
  (an exchange argument; tests check it against exhaustive search);
- anti-affinity: among equally good domains, the node (then rack) holding the fewest replicas of this pool
  first, so one node's failure takes as few of the pool's replicas as possible;
- pairs: among domains still equal, the closest to the partner pool's replicas (`near`: decode replicas
  near the prefill ones, whose KV they receive).
Fewer than n fit: as many as fit, and the rest reported as unplaced.

upgrade_plan() replaces a pool's replicas group by group with at most `surge` extra replicas at a time;
distance() ranks how close two replicas are (same domain 0, same node 1, same rack 2, else 3; the same ranks
as services.common.host.distance on the "rack/node/domain" paths workers report): the router breaks ties
between decode workers by it.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass

from services.common import host


@dataclass(frozen=True)
class Device:
    id: str
    rack: str
    node: str
    domain: str  # NVLink island or NUMA domain, unique within its node


@dataclass(frozen=True)
class Replica:
    pool: str
    devices: tuple  # Device ids, all in one domain
    rack: str
    node: str
    domain: str

    @property
    def topology(self) -> str:
        """Its place as the "rack/node/domain" path its workers report (MESHSERVE_TOPOLOGY)."""
        return f"{self.rack}/{self.node}/{self.domain}"


@dataclass
class Placement:
    replicas: list  # Replica, placed now
    unplaced: int  # replicas that did not fit
    stranded: int  # free devices left in domains that cannot take another replica of this size


def domains_of(inventory: list[Device], used: set) -> dict:
    """(rack, node, domain) -> free device ids, in inventory order."""
    out: dict = defaultdict(list)
    for d in inventory:
        out[(d.rack, d.node, d.domain)]
        if d.id not in used:
            out[(d.rack, d.node, d.domain)].append(d.id)
    return out


def stranded(free_by_domain: dict, k: int) -> int:
    return sum(len(f) for f in free_by_domain.values() if len(f) < k)


def place(inventory: list[Device], used: set, pool: str, k: int, n: int, existing: list | None = None,
          near: list | None = None) -> Placement:
    """n replicas of k devices for `pool` on the free devices (see module doc). existing: the pool's replicas
    already placed (anti-affinity counts them). near: the partner pool's replicas (decode for prefill, or the
    reverse): among domains equally good by stranding and anti-affinity, the closest to one of them first."""
    if k < 1 or n < 0:
        raise ValueError(f"replica size must be >= 1 and count >= 0, got k={k} n={n}")
    free = domains_of(inventory, used)
    per_node = Counter(r.node for r in existing or [])
    per_rack = Counter(r.rack for r in existing or [])
    taken = Counter()  # domain -> replicas placed there now
    # Phase 1: replicas that strand nothing (at most q - 1 per domain); phase 2: fill domains completely,
    # smallest remainder first.
    spare = {key: max(len(f) // k - 1, 0) for key, f in free.items()}
    replicas: list[Replica] = []

    close = {key: min((host.distance("/".join(key), r.topology) for r in near or []), default=0) for key in free}

    def rank(x):  # only ever grows as replicas are placed: a lazy heap stays exact
        return per_node[x[1]], per_rack[x[0]], close[x], -(len(free[x]) - k * taken[x]), x

    heap = [rank(key) for key in free if spare[key] > 0]
    heapq.heapify(heap)
    while len(replicas) < n and heap:
        entry = heapq.heappop(heap)
        key = entry[-1]
        now = rank(key)
        if now != entry:
            heapq.heappush(heap, now)
            continue
        replicas.append(_take(free, key, k, taken, pool, per_node, per_rack))
        if taken[key] < spare[key]:
            heapq.heappush(heap, rank(key))
    fill = sorted((key for key in free if len(free[key]) - k * taken[key] >= k),
                  key=lambda x: ((len(free[x]) - k * taken[x]) % k, per_node[x[1]], per_rack[x[0]], close[x], x))
    for key in fill:
        if len(replicas) >= n:
            break
        replicas.append(_take(free, key, k, taken, pool, per_node, per_rack))
    left = {key: f[k * taken[key]:] for key, f in free.items()}
    return Placement(replicas, n - len(replicas), stranded(left, k))


def _take(free, key, k, taken, pool, per_node, per_rack) -> Replica:
    start = k * taken[key]
    taken[key] += 1
    per_node[key[1]] += 1
    per_rack[key[0]] += 1
    return Replica(pool, tuple(free[key][start:start + k]), key[0], key[1], key[2])


def optimum_stranded(inventory: list[Device], used: set, k: int, n: int) -> int | None:
    """The fewest stranded devices over every way of placing n replicas of size k (exhaustive; small instances
    only). None when n do not fit."""
    caps = [len(f) for f in domains_of(inventory, used).values()]
    best = None

    def go(i: int, left: int, acc: list):
        nonlocal best
        if i == len(caps):
            if left == 0:
                s = sum(c - k * g for c, g in zip(caps, acc) if c - k * g < k)
                best = s if best is None else min(best, s)
            return
        for g in range(min(caps[i] // k, left) + 1):
            go(i + 1, left - g, acc + [g])

    go(0, n, [])
    return best


def upgrade_plan(replicas: list[Replica], surge: int) -> list[list[tuple[str, Replica]]]:
    """Rolling replacement, group by group: each wave adds up to `surge` new replicas ("add", the old one they
    replace) and then removes those old ones ("remove"); a pool never has more than surge extra replicas."""
    if surge < 1:
        raise ValueError("surge must be >= 1")
    waves = []
    for i in range(0, len(replicas), surge):
        batch = replicas[i:i + surge]
        waves.append([("add", r) for r in batch] + [("remove", r) for r in batch])
    return waves


def distance(a: Replica, b: Replica) -> int:
    """0 same domain, 1 same node, 2 same rack, 3 otherwise (the router's tie-break uses the same ranks)."""
    return host.distance(a.topology, b.topology)


def inventory(racks: int, nodes_per_rack: int, domains_per_node: int, devices_per_domain: int) -> list[Device]:
    """A uniform inventory (for tests and benchmarks)."""
    return [Device(f"r{r}n{n}d{d}g{g}", f"r{r}", f"r{r}n{n}", f"d{d}")
            for r in range(racks) for n in range(nodes_per_rack) for d in range(domains_per_node)
            for g in range(devices_per_domain)]
