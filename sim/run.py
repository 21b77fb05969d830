"""Cells in parallel: a cluster whose cells share nothing runs as one process per core, with the same result.

With cell_size > 0, no gateway queue (admission "none": every request goes straight to its cell's router) and
no autoscaling, cells are independent: the gateway hands request i of the trace to cell i mod C, and nothing
else crosses cells. Each cell then runs as its own Cluster on its share of the trace, with the same worker ids
as in the whole cluster (so that tie-breaks by worker id agree), in a pool of processes, and the results merge
in cell order. The merged result is the single-process one, byte for byte (tests/unit/test_sim.py checks it).

The pool's processes come from a fork server, never from forking the caller: a caller with threads (gRPC's
poller, tqdm's monitor, a test run that has served gRPC in-process) can hold a lock at the fork that the child
then waits on for ever, which hung a CI run in this very test.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from sim.cluster import Cluster, ClusterSpec
from sim.cost import CostModel

DEFAULT_COST = "sim-cost.json"  # the cost model `meshserve sim` reads unless given one


def log(msg: str) -> None:
    print(f"[sim] {msg}", file=sys.stderr, flush=True)


def splittable(spec: ClusterSpec) -> bool:
    if not spec.cell_size or spec.admission != "none" or spec.autoscale is not None:
        return False
    n = len(cells(spec))
    return all(count >= n for count in _counts(spec).values())


def _counts(spec: ClusterSpec) -> dict:
    return {"prefill": spec.prefill, "decode": spec.workers} if spec.mode == "disaggregated" else \
        {"unified": spec.workers}


def cells(spec: ClusterSpec) -> list[dict]:
    """Each cell's worker ids by role, as Cluster._assign_cells deals them."""
    counts = _counts(spec)
    n = max(1, max(math.ceil(c / spec.cell_size) for c in counts.values()))
    return [{role: [f"{role}-{i}" for i in range(c) if i % n == j] for role, c in counts.items()} for j in range(n)]


def _run_cell(args) -> tuple:
    spec, cost, trace, ids, j, n = args
    counts = {role: len(v) for role, v in ids.items()}
    sub = replace(spec, cell_size=0, workers=counts.get("unified", counts.get("decode", 0)),
                  prefill=counts.get("prefill", 0))
    cluster = Cluster(sub, cost, worker_ids=ids)
    cluster.run(trace)
    for r in cluster.done:
        r.seq_no = j + n * r.seq_no
        r.pending, r.gateway, r.hashes, r.workers = None, None, [], []
    return cluster.done, cluster.worker_stats(), cluster.processed, cluster.now


class Merged:
    """The parts of a Cluster that sim.report.result_of reads, merged over cells."""

    def __init__(self, spec: ClusterSpec, parts: list):
        self.spec = spec
        self.done = [r for p in parts for r in p[0]]
        self._stats = [w for p in parts for w in p[1]]
        self.processed = sum(p[2] for p in parts)
        self.now = max(p[3] for p in parts)
        self.timeline = [(0.0, len(self._stats), 0)]

    def worker_stats(self) -> list[dict]:
        return self._stats


def pool(processes: int, initializer=None, initargs: tuple = ()) -> ProcessPoolExecutor:
    """A pool of `processes` workers forked from a fresh single-threaded server (see the module's docstring)."""
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("forkserver"),
                               initializer=initializer, initargs=initargs)


def run_cells(spec: ClusterSpec, cost: CostModel, trace: list, processes: int) -> Merged:
    groups = cells(spec)
    n = len(groups)
    tasks = [(spec, cost, trace[j::n], ids, j, n) for j, ids in enumerate(groups)]
    if processes <= 1:
        parts = [_run_cell(t) for t in tasks]
    else:
        with pool(processes) as workers:
            parts = list(workers.map(_run_cell, tasks))
    return Merged(spec, parts)


def simulate(spec: ClusterSpec, cost: CostModel, trace: list, progress: bool = False, processes: int = 1) -> dict:
    """Run one simulation; the result JSON (sim/report.py). processes > 1: independent cells in parallel
    (run_cells), when the spec allows it."""
    from sim.report import result_of

    t0 = time.perf_counter()
    if splittable(spec):
        cluster = run_cells(spec, cost, trace, processes)
    else:
        cluster = Cluster(spec, cost)
        cluster.run(trace)
    wall = time.perf_counter() - t0
    if progress:
        log(f"{len(trace)} requests, {cluster.processed} events in {wall:.1f} s "
            f"({cluster.processed / max(wall, 1e-9):,.0f} events/s)")
    return result_of(cluster, wall)
