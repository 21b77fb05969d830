"""`meshserve sim claims placement`: the seed's placement claim (09) on a 1,000-host, multi-rack topology: the mesh's
placement policy (services.policy.placement.place, what the launcher and the autoscaler's actuators call) against
first fit (the first host by name with room), on the same stream of groups.

Topology: --hosts hosts of 8 devices in racks of 40. Groups arrive as an autoscaler adds them, in batches of one
role (1-32 groups at a time, one at a time within the batch): prefill groups of tensor-parallel size 2 or 4, decode
groups of 1, 2, 4 or 8, a prefill device for every three decode devices, until the groups hold `load` of the devices;
then churn: a fifth of the groups, drawn at random, leave, and as many devices' worth of new batches arrive
(scale-down and up, as a day brings). Measured after the churn:

- kv_cross_rack: the fraction of KV bytes that cross racks. Each prefill device feeds three decode devices' worth of
  KV; decode devices take it from prefill capacity on their own host first, then in their rack, then anywhere (the
  router's preference by distance, services.common.host): the matching on the host-rack tree, in closed form;
- kv_cross_host: likewise, the fraction that leaves the host (shared memory no longer applies);
- fragmented_hosts: hosts in use whose free devices cannot take the largest group (8) yet are not full, as a
  fraction of all hosts; and whole_free_hosts, the hosts left empty (what scaling down can give back);
- unplaced: groups that found no host.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from services.policy.placement import Group, Host, free_cores, place

DEVICES, RACK = 8, 40
DECODE_SIZES = (1, 2, 4, 8)
PREFILL_SIZES = (2, 4)
LARGEST = 8
FEEDS = 3  # decode devices one prefill device feeds


@dataclass
class Demand:
    role: str
    size: int


def topology(n: int) -> list[Host]:
    return [Host(f"h{i:05d}", DEVICES, rack=f"r{i // RACK:03d}") for i in range(n)]


def first_fit(hosts: list[Host], placed: list, pool: str, role: str, size: int) -> Group | None:
    free = free_cores(hosts, placed)
    for h in hosts:
        if free[h.name] >= size:
            return Group(pool, role, h.name, size)
    return None


def demands(rng: random.Random, devices: int) -> list[Demand]:
    """Batches of one role, 1-32 groups each, keeping a prefill device for every FEEDS decode devices."""
    out, by = [], {"prefill": 0, "decode": 0}
    while sum(by.values()) < devices:
        role = "prefill" if by["prefill"] * FEEDS < by["decode"] else "decode"
        for _ in range(rng.randint(1, 32)):
            d = Demand(role, rng.choice(PREFILL_SIZES if role == "prefill" else DECODE_SIZES))
            out.append(d)
            by[role] += d.size
    return out


class Placer:
    """One policy's running placement (kept incrementally: place() asks for free cores from the groups placed)."""

    def __init__(self, hosts: list[Host], policy: str):
        self.hosts, self.policy = hosts, policy
        self.groups: list[Group] = []
        self.unplaced = 0

    def add(self, d: Demand) -> None:
        if self.policy == "first-fit":
            g = first_fit(self.hosts, self.groups, d.role, d.role, d.size)
            placed = [g] if g else []
        else:
            p = place(self.hosts, self.groups, d.role, d.role, d.size, 1)
            placed = p.groups
        self.groups += placed
        self.unplaced += 0 if placed else 1


def metrics(hosts: list[Host], groups: list[Group], unplaced: int) -> dict:
    rack = {h.name: h.rack for h in hosts}
    need: dict = {}  # host -> decode devices
    feed: dict = {}  # host -> decode devices its prefill groups can feed
    for g in groups:
        into = need if g.role == "decode" else feed
        into[g.host] = into.get(g.host, 0) + g.size * (1 if g.role == "decode" else FEEDS)
    bytes_total = sum(need.values())
    on_host = {h: min(n, feed.get(h, 0)) for h, n in need.items()}
    left_need, left_feed = {}, {}
    for h in set(need) | set(feed):
        r = rack[h]
        left_need[r] = left_need.get(r, 0) + need.get(h, 0) - on_host.get(h, 0)
        left_feed[r] = left_feed.get(r, 0) + feed.get(h, 0) - on_host.get(h, 0)
    in_rack = sum(min(n, left_feed.get(r, 0)) for r, n in left_need.items())
    cross_host = bytes_total - sum(on_host.values())
    cross_rack = cross_host - in_rack
    free = free_cores(hosts, groups)
    fragmented = sum(1 for h in hosts if 0 < free[h.name] < LARGEST)
    empty = sum(1 for h in hosts if free[h.name] == h.cores)
    return {"kv_cross_rack": round(cross_rack / bytes_total, 4) if bytes_total else None,
            "kv_cross_host": round(cross_host / bytes_total, 4) if bytes_total else None,
            "fragmented_hosts": round(fragmented / len(hosts), 4), "whole_free_hosts": empty,
            "unplaced": unplaced, "groups": len(groups)}


def measure(hosts_n: int, loads: tuple, seed: int = 0) -> dict:
    hosts = topology(hosts_n)
    devices = hosts_n * DEVICES
    out = {}
    for load in loads:
        by = {}
        for policy in ("first-fit", "meshserve"):
            rng = random.Random(seed)
            p = Placer(hosts, policy)
            for d in demands(rng, int(load * devices)):
                p.add(d)
            leaving = set(rng.sample(range(len(p.groups)), len(p.groups) // 5))
            gone = sum(g.size for i, g in enumerate(p.groups) if i in leaving)
            p.groups = [g for i, g in enumerate(p.groups) if i not in leaving]
            for d in demands(rng, gone):
                p.add(d)
            by[policy] = metrics(hosts, p.groups, p.unplaced)
        out[f"{load:g}"] = by
    return out
