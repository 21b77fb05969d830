"""The autoscaler on real processes: `meshserve up` with the autoscaler on and the local actuator; a burst makes it
add a unified worker, which registers and takes traffic; after the burst it drains it away; no request fails;
the decisions and their reasons are in the autoscaler's log and metrics. And `meshserve scale` by hand."""

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
import yaml

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from tests.support.wait import wait_for as wait

CONFIG = {
    "mesh": {"mode": "unified", "unified": 1, "tls": False},
    "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "kv_cache_gb": 0.05},
    "autoscaler": {"enabled": True, "interval_s": 1.0, "export_interval_ms": 500, "pools": {"unified": {
        "min_replicas": 1, "max_replicas": 2, "decode_tokens_per_s": 40, "prefill_tokens_per_s": 400,
        "startup_s": 5, "cooldown_s": 3, "down_window_s": 8, "window_s": 6, "max_step": 1}}},
}


# no demand left, as the token policy says it: "no traffic", or a demand of 0 while a worker still reports KV in use
IDLE = r"(no traffic|prompt 0 tok/s[^)]*-> 0\.00; output 0 tok/s[^)]*-> 0\.00)"

# by hand: no autoscaler, and a named group of unified workers (an adapter group's), none at start
MANUAL = {"mesh": {**CONFIG["mesh"], "worker_pools": {"lora": {"role": "unified", "replicas": 0}}},
          "engine": CONFIG["engine"]}


@pytest.fixture
def up(tmp_path, request):
    config = getattr(request, "param", CONFIG)
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", "tiny", "--config", "mesh.yaml",
                             "--port", "0", "--http-port", "0", "--router-port", "0", "--kvstore-port", "0",
                             "--supervisor-port", "0", "--autoscaler-port", "0"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"\bready\b", line):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(180), "".join(lines)
    yield proc, lines
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(60)


def wait_for(predicate, timeout_s: float, what: str, lines):
    wait(predicate, timeout_s, lambda: f"{what} did not happen:\n" + "".join(lines[-40:]), interval_s=0.5)


def pools(supervisor: str) -> dict:
    with grpc.insecure_channel(supervisor) as ch:
        return {p.pool: p for p in pb_grpc.SupervisorStub(ch).Pools(pb.PoolsRequest(), timeout=5).pools}


def generate(gateway: str, i: int) -> int:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5 + i % 50] * 24),
                             sampling=pb.Sampling(max_tokens=48, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(gateway) as ch:
        return sum(len(r.token_ids) for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=120))


def test_a_burst_adds_a_worker_that_takes_traffic_and_drains_it_after(up):
    proc, lines = up
    text = "".join(lines)
    gateway = next(ln.strip() for ln in lines if re.fullmatch(r"127\.0\.0\.1:\d+", ln.strip()))
    supervisor = re.search(r"--supervisor (127\.0\.0\.1:\d+)", text).group(1)
    assert pools(supervisor)["unified"].ready == 1
    stop, done, failed = threading.Event(), [], []

    def load():
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            i = 0
            while not stop.is_set():
                futures = [pool.submit(generate, gateway, i + k) for k in range(12)]
                i += 12
                for f in futures:
                    try:
                        done.append(f.result())
                    except grpc.RpcError as e:
                        failed.append(f"{e.code().name}: {e.details()}")

    burst = threading.Thread(target=load)
    burst.start()
    try:
        wait_for(lambda: pools(supervisor)["unified"].ready == 2, 120, "a second worker", lines)
        first = len(done)
        wait_for(lambda: worker_served(lines, "unified-1") > 0, 60, "traffic on the new worker", lines)
    finally:
        stop.set()
        burst.join(180)
    assert first > 0 and not failed, failed[:3]
    assert all(n == 48 for n in done)  # every request whole
    wait_for(lambda: pools(supervisor)["unified"].ready == 1 and pools(supervisor)["unified"].draining == 0, 120,
             "the drain after the burst", lines)
    text = "".join(lines)
    assert re.search(r"scale unified: started unified-1 \(token-policy: ", text), text[-3000:]
    assert re.search(r"scale unified: draining unified-1 \(token-policy: " + IDLE, text), text[-3000:]
    assert "unified-1 drained" in text
    log = open(re.search(r"its decisions in (\S+)", text).group(1)).read()
    assert re.search(r"unified: up to 2 \(prompt \d+ tok/s", log), log[-2000:]
    assert re.search(r"unified: drain to 1 \(" + IDLE, log), log[-2000:]
    body = urllib.request.urlopen(re.search(r"metrics on (http://\S+/metrics)", log).group(1),
                                  timeout=5).read().decode()
    ups = [ln for ln in body.splitlines() if ln.startswith("meshserve:autoscaler_decisions_total")
           and 'kind="up"' in ln]
    assert ups and 'pool="unified"' in ups[0] and ups[0].endswith(" 1")


def listed(lines) -> list:
    """The workers the router lists."""
    router = re.search(r"router (127\.0\.0\.1:\d+)", "".join(lines)).group(1)
    with grpc.insecure_channel(router) as ch:
        return list(pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers)


def registered(lines) -> list[str]:
    return [w.worker_id for w in listed(lines)]


def worker_served(lines, name: str) -> int:
    """Requests the named worker holds now (its Stats, found through the router's list of workers)."""
    address = next((w.address for w in listed(lines) if w.worker_id == name), None)
    if address is None:
        return 0
    with grpc.insecure_channel(address) as ch:
        s = pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)
    return s.running + s.waiting


@pytest.mark.parametrize("up", [MANUAL], indirect=True)
def test_meshserve_scale_by_hand(up):
    proc, lines = up
    supervisor = re.search(r"--supervisor (127\.0\.0\.1:\d+)", "".join(lines)).group(1)
    assert "(pools: unified, lora)" in "".join(lines)
    cli = [sys.executable, "-m", "services.cli", "scale", "--supervisor", supervisor]
    bad = subprocess.run(cli + ["decode", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "unified, lora" in bad.stderr
    group = subprocess.run(cli + ["lora", "1"], capture_output=True, text=True, timeout=60)
    assert group.returncode == 0 and "lora: 0 ready, 1 starting, 0 draining (lora-0)" in group.stdout, group.stderr
    wait_for(lambda: pools(supervisor)["lora"].ready == 1, 120, "the group's worker", lines)
    wait_for(lambda: "lora-0" in registered(lines), 30, "the group's worker registering", lines)
    bad = subprocess.run(cli + ["unified", "500"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "OUT_OF_RANGE" in bad.stderr
    ok = subprocess.run(cli + ["unified", "1"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "unified: 1 ready, 0 starting, 0 draining (unified-0)" in ok.stdout, ok.stderr


# from zero: no worker at the start; the autoscaler may go down to none again
FROM_ZERO = {"mesh": {**CONFIG["mesh"], "unified": 0}, "engine": CONFIG["engine"],
             "autoscaler": {**CONFIG["autoscaler"], "pools": {"unified": {
                 **CONFIG["autoscaler"]["pools"]["unified"], "min_replicas": 0, "max_replicas": 1}}}}


@pytest.mark.parametrize("up", [FROM_ZERO], indirect=True)
def test_a_request_to_an_empty_pool_makes_the_autoscaler_start_a_worker_that_serves_it(up):
    """Scale from zero: the gateway holds the request (the pool has no worker) and exports that it does; the
    autoscaler starts a worker; the request is served whole. Then, idle, the pool goes back to zero."""
    proc, lines = up
    text = "".join(lines)
    gateway = next(ln.strip() for ln in lines if re.fullmatch(r"127\.0\.0\.1:\d+", ln.strip()))
    supervisor = re.search(r"--supervisor (127\.0\.0\.1:\d+)", text).group(1)
    assert pools(supervisor)["unified"].ready == 0 and registered(lines) == []
    assert generate(gateway, 0) == 48  # held, then served by the worker the autoscaler started for it
    text = "".join(lines)
    assert re.search(r"scale unified: started unified-0 \(token-policy: 1 request\(s\) wait for a worker", text), \
        text[-3000:]
    wait_for(lambda: pools(supervisor)["unified"].ready == 0 and pools(supervisor)["unified"].draining == 0, 120,
             "the drain back to zero", lines)
    log = open(re.search(r"its decisions in (\S+)", "".join(lines)).group(1)).read()
    assert re.search(r"unified: up to 1 \(1 request\(s\) wait for a worker and the pool has none", log), log[-2000:]
    assert re.search(r"unified: drain to 0 \(" + IDLE, log), log[-2000:]
