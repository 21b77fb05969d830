"""Workload soak (issue 19; outside CI): mixed load with random cancels and one random SIGKILL per minute.

A supervised mesh as `meshserve up` runs it (mutual TLS, 1 prefill + 2 decode workers, two routers) serves
`--concurrency` client loops for `--soak-s` seconds, or with `--rate R` an open loop of Poisson arrivals at R
requests/s whatever the mesh completes (run a closed loop first: twice its completed/s is "2x the sustainable rate",
and what the gateway sheds at its admission bound is counted as rejected, by reason, apart from errors). Each sends one
of 64 fixed requests (prompts of 16-256 tokens, 16-96 new tokens, half greedy and half seeded sampling at temperature
0.8) and cancels one in five at a random moment 0-2 s in. Every `--kill-every-s` seconds one service picked at random (a
decode or the prefill worker, the kvstore, a router, Redis) is killed with SIGKILL; the supervisor starts it again.

What it checks and reports:
- every completed request equals the first completion of the same request (0 duplicated or missing tokens across
  resumes); errors other than the intended cancels, by status;
- the resident memory (VmRSS) of every service with its child processes (a worker's engine core), sampled every 10 s:
  after the first minute (warm) and at the end, for the gateway and for the services never killed (a restarted one
  starts afresh); the target is within 10%;
- afterwards: blocks, sequences and transfers still held (target 0).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from bench.common import default_model, log, machine, write_result
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec, client_channel

ENGINE_ARGS = ["--kv-cache-gb", "0.25", "--max-num-batched-tokens", "256"]
VICTIMS = ("decode-0", "decode-1", "prefill-0", "kvstore", "router", "router-1", "redis")
RSS_PERIOD_S = 10.0


def add_flags(p) -> None:
    g = p.add_argument_group("soak")
    g.add_argument("--soak-s", type=float, default=600.0, help="soak: seconds of load")
    g.add_argument("--kill-every-s", type=float, default=60.0, help="soak: one random SIGKILL this often (0 = none)")
    g.add_argument("--concurrency", type=int, default=12, help="soak: client loops (closed loop)")
    g.add_argument("--rate", type=float, default=None,
                   help="soak: open loop instead, Poisson arrivals at this many requests/s (e.g. 2x what a closed-loop "
                        "run completes per second); rejections at the admission bound are counted apart")


def _requests(seed: int) -> list[pb.GenerateRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(64):
        ids = [rng.randrange(3, 32000) for _ in range(rng.randint(16, 256))]
        sampling = pb.Sampling(max_tokens=rng.randint(16, 96), ignore_eos=True, temperature=0.0)
        if i % 2:
            sampling.temperature, sampling.seed = 0.8, rng.randrange(1 << 32)
        out.append(pb.GenerateRequest(request_id=f"soak-{i}", token_ids=pb.TokenIds(ids=ids), sampling=sampling))
    return out


def _rss_mb(pid: int) -> float | None:
    """Resident MB of a service: its process and every descendant (a worker's engine core is its child)."""
    from bench.proc_cpu import descendants

    total, found = 0.0, False
    for p in descendants(pid):
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total, found = total + int(line.split()[1]) / 1024, True
        except OSError:
            continue
    return total if found else None


class Soak:
    def __init__(self, mesh: Mesh, reqs: list, seed: int):
        self.mesh, self.reqs, self.rng = mesh, reqs, random.Random(seed + 1)
        self.outcomes: Counter = Counter()
        self.errors: Counter = Counter()
        self.rejections: Counter = Counter()  # RESOURCE_EXHAUSTED by reason (numbers stripped)
        self.tokens = 0  # output tokens of completed requests
        self.first: dict[int, list] = {}  # request index -> its first completed tokens
        self.mismatches: list = []
        self.kills: list = []
        self.rss: list = []  # (seconds since start, {service: MB})
        self.rss_end: dict = {}  # {service: MB} as the load stops

    async def client(self, stub, until: float) -> None:
        """One closed-loop client: the next request as soon as the last one ends."""
        while time.monotonic() < until:
            await self.one(stub)

    async def arrivals(self, stub, rate: float, until: float) -> None:
        """Open loop: Poisson arrivals at `rate` per second whatever the mesh manages, each its own task."""
        tasks = set()
        next_at = time.monotonic()
        while (now := time.monotonic()) < until:
            if now < next_at:
                await asyncio.sleep(next_at - now)
                continue
            task = asyncio.ensure_future(self.one(stub))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += self.rng.expovariate(rate)
        await asyncio.gather(*tasks)

    async def one(self, stub) -> None:
        """Send one of the fixed requests, cancel one in five, and record the outcome."""
        i = self.rng.randrange(len(self.reqs))
        cancel_at = self.rng.uniform(0, 2.0) if self.rng.random() < 0.2 else None
        call = stub.Generate(self.reqs[i], timeout=120)
        tokens, t0 = [], time.monotonic()
        try:
            async for r in call:
                tokens += r.token_ids
                if cancel_at is not None and time.monotonic() - t0 >= cancel_at:
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # shed at a bound, with its reason: not a failure
                self.outcomes["rejected"] += 1
                self.rejections[_reason(e.details())] += 1
                return
            if e.code() != grpc.StatusCode.CANCELLED:
                self.errors[f"{e.code().name}: {_reason(e.details())}"] += 1
                self.outcomes["error"] += 1
                return
        if cancel_at is not None and call.cancelled():
            self.outcomes["cancelled"] += 1
            return
        self.outcomes["completed"] += 1
        self.tokens += len(tokens)
        want = self.first.setdefault(i, tokens)
        if tokens != want:
            self.mismatches.append({"request": i, "got": len(tokens), "want": len(want)})

    def killer(self, start: float, until: float, every_s: float, stop: threading.Event) -> None:
        next_kill = start + every_s
        while not stop.wait(0.2) and time.monotonic() < until - 5:
            if every_s and time.monotonic() >= next_kill:
                victim = self.rng.choice(VICTIMS)
                proc = self.mesh.proc(victim)
                os.killpg(proc.popen.pid, signal.SIGKILL)
                self.kills.append({"at_s": round(time.monotonic() - start, 1), "service": victim})
                log(f"killed {victim}")
                next_kill += every_s

    def sampler(self, start: float, stop: threading.Event) -> None:
        while True:
            self.rss.append((round(time.monotonic() - start, 1),
                             {p.name: _rss_mb(p.popen.pid) for p in self.mesh.procs}))
            if stop.wait(RSS_PERIOD_S):
                return

    async def drive(self, concurrency: int, duration_s: float, rate: float | None = None) -> None:
        until = time.monotonic() + duration_s
        async with grpc.aio.insecure_channel(self.mesh.gateway) as ch:
            stub = pb_grpc.GenerationStub(ch)
            if rate:
                await self.arrivals(stub, rate, until)
            else:
                await asyncio.gather(*(self.client(stub, until) for _ in range(concurrency)))


def _reason(details: str) -> str:
    """A rejection's message with its figures replaced, so that rejections group by cause."""
    return re.sub(r"\d+(\.\d+)?", "N", details)[:160]


def _held(mesh: Mesh) -> dict:
    held = {}
    for p in mesh.workers("prefill") + mesh.workers("decode"):
        with client_channel(p.address, mesh.tls_dir) as ch:
            s = pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)
        if s.blocks_used or s.running or s.waiting:
            held[p.name] = {"blocks": s.blocks_used, "running": s.running, "waiting": s.waiting}
    with client_channel(mesh.kvstore, mesh.tls_dir) as ch:
        transfers = pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=5).transfers
    if transfers:
        held["kvstore"] = {"transfers": transfers}
    return held


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    duration = 120.0 if args.quick else args.soak_s
    spec = MeshSpec(str(model_dir), mode="disaggregated", decode=2, routers=2, tls=True, engine_args=ENGINE_ARGS)
    with Mesh(spec) as mesh:
        stop, stop_supervising = threading.Event(), threading.Event()
        supervisor = threading.Thread(target=lambda: [mesh.supervise(log)
                                                      for _ in iter(lambda: stop_supervising.wait(0.1), True)])
        supervisor.start()
        soak = Soak(mesh, _requests(args.seed), args.seed)
        start = time.monotonic()
        threads = [threading.Thread(target=soak.killer, args=(start, start + duration, args.kill_every_s, stop)),
                   threading.Thread(target=soak.sampler, args=(start, stop))]
        for t in threads:
            t.start()
        load = f"{args.rate:g} req/s open loop" if args.rate else f"{args.concurrency} client loops"
        log(f"soak: {duration:g} s, {load}, a kill every {args.kill_every_s:g} s")
        try:
            asyncio.run(soak.drive(args.concurrency, duration, args.rate))
            soak.rss_end = {p.name: _rss_mb(p.popen.pid) for p in mesh.procs}
            stop.set()
            for t in threads:
                t.join()
            deadline, held = time.monotonic() + 30, None
            while time.monotonic() < deadline:
                try:
                    held = _held(mesh)
                except grpc.RpcError as e:  # a service still coming back
                    held = {"unreachable": e.code().name}
                if not held:
                    break
                time.sleep(0.5)
        finally:
            stop.set()
            stop_supervising.set()
            supervisor.join()
    result = _result(args, soak, duration, held)
    write_result(result, args.out)
    s = result["systems"]["mesh-soak"]
    print(f"soak {duration:g} s: {s['completed']} completed ({s['completed_per_s']:g}/s), {s['cancelled']} cancelled, "
          f"{s['rejected']} rejected at a bound, {s['errors']} errors, "
          f"{s['mismatched']} mismatched, kills {len(soak.kills)}; held after: {held or 'nothing'}")
    for name, r in result["rss"].items():
        print(f"  {name:12} RSS {r['warm_mb']:8.1f} -> {r['end_mb']:8.1f} MB ({r['change']:+.1%})")
    return 0


def _result(args, soak: Soak, duration: float, held: dict | None) -> dict:
    killed = {k["service"] for k in soak.kills}
    warm = next((rss for at, rss in soak.rss if at >= 60), soak.rss[-1][1])
    end = soak.rss_end
    rss = {name: {"warm_mb": round(warm[name], 1), "end_mb": round(end[name], 1),
                  "change": round(end[name] / warm[name] - 1, 4)}
           for name in warm if name not in killed and warm.get(name) and end.get(name)}
    return {"workload": "soak", "command": args.command_line, "machine": machine(),
            "config": {"duration_s": duration, "concurrency": None if args.rate else args.concurrency,
                       "rate_per_s": args.rate, "kill_every_s": args.kill_every_s,
                       "cancel_fraction": 0.2, "requests": 64, "engine_args": ENGINE_ARGS, "routers": 2, "tls": True},
            "systems": {"mesh-soak": {"completed": soak.outcomes["completed"], "cancelled": soak.outcomes["cancelled"],
                                      "rejected": soak.outcomes["rejected"], "errors": soak.outcomes["error"],
                                      "completed_per_s": round(soak.outcomes["completed"] / duration, 3),
                                      "output_tok_per_s": round(soak.tokens / duration, 1),
                                      "mismatched": len(soak.mismatches),
                                      "kills": len(soak.kills),
                                      "max_rss_change_unkilled": max((abs(r["change"]) for r in rss.values()),
                                                                     default=None)}},
            "errors": dict(soak.errors), "rejections": dict(soak.rejections), "mismatches": soak.mismatches[:20],
            "kills": soak.kills, "rss": rss,
            "rss_samples": soak.rss, "held_after": held or {}}
