"""`meshserve up` supervises its services (issue 19): a service killed with SIGKILL is started again on the same
address (its metrics' too, issue 65) and the mesh serves again; a killed `up` leaves no process behind."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from tests.support.procs import processes_in

READY = re.compile(r"meshserve is ready: gateway (\S+), HTTP \S+, router \S+, kvstore \S+, redis \S+")


def start_up(folder) -> tuple[subprocess.Popen, str, list]:
    """`meshserve up` of the split topology (1 prefill + 2 decode workers; a small machine's default is one unified
    worker, services.policy.machine)."""
    (folder / "mesh.yaml").write_text("mesh: {mode: disaggregated}\n")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", "tiny", "--config", "mesh.yaml",
                             "--port", "0", "--http-port", "0", "--router-port", "0", "--kvstore-port", "0",
                             "--supervisor-port", "0"], cwd=folder,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if found := READY.search(line):
            return proc, found.group(1), lines
    pytest.fail("up never got ready:\n" + "".join(lines))


def service_pid(folder, marker: str) -> int | None:
    """The pid of the process of the mesh whose command line holds marker (e.g. 'services.router')."""
    for pid in processes_in(folder):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd and " up " not in cmd:
            return pid
    return None


def generate(gateway: str, timeout_s: float = 30) -> list:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(3, 30))),
                             sampling=pb.Sampling(max_tokens=6, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(gateway) as ch:
        return [t for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=timeout_s) for t in r.token_ids]


def serves_again(gateway: str, within_s: float) -> list:
    """Retry a request until it succeeds (the mesh recovering) or within_s passes."""
    deadline, last = time.monotonic() + within_s, None
    while time.monotonic() < deadline:
        try:
            return generate(gateway, timeout_s=10)
        except grpc.RpcError as e:
            last = e
            time.sleep(0.2)
    pytest.fail(f"the mesh did not serve again within {within_s} s: {last}")


@pytest.fixture
def up(tmp_path):
    proc, gateway, lines = start_up(tmp_path)
    yield tmp_path, proc, gateway, lines
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=60)


# Redis and the router first: the rest of the mesh must come back to them. One decode worker of two.
@pytest.mark.parametrize("marker", ["redis-server", "services.router", "services.kvstore",
                                    "--worker-id decode-0", "--worker-id prefill-0", "services.gateway"])
def test_a_killed_service_is_started_again_and_the_mesh_serves(up, marker):
    folder, proc, gateway, lines = up
    want = generate(gateway)
    victim = service_pid(folder, marker)
    assert victim, f"no process with {marker!r}"
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while service_pid(folder, marker) in (None, victim):
        assert time.monotonic() < deadline, f"{marker} not started again within 5 s"
        time.sleep(0.1)
    assert serves_again(gateway, within_s=30) == want  # greedy: the same tokens as before the kill
    assert proc.poll() is None, "up itself stopped"
    for url in printed_metrics(lines):  # the restarted service is back on the address `up` printed (issue 65)
        answers_within(url, 30)
    # its pool, as the Supervisor reports it: whole again, start-up measured afresh
    if marker.startswith("--worker-id"):
        pool = marker.split()[1].rsplit("-", 1)[0]
        deadline = time.monotonic() + 30
        while (state := pool_state(lines, pool)).ready < len(state.workers):
            assert state.startup_s >= 0, state  # issue 43: a restart kept its old healthy time (negative start-ups)
            assert time.monotonic() < deadline, f"{pool} not whole again within 30 s: {state}"
            time.sleep(0.2)
        assert state.startup_s > 0, state


def printed_metrics(lines: list) -> list:
    found = re.search(r"metrics \(Prometheus text\): (.*)", "".join(lines))
    assert found, "up printed no metrics addresses"
    return re.findall(r"(http://\S+/metrics)", found.group(1))


def answers_within(url: str, within_s: float) -> None:
    deadline, last = time.monotonic() + within_s, None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                assert r.status == 200
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    pytest.fail(f"{url} does not answer within {within_s} s: {last}")


def pool_state(lines: list, pool: str) -> pb.PoolState:
    """The Supervisor's view of a pool, asked as the operator over the mesh's mutual TLS (as `meshserve scale`)."""
    from services.mesh.launcher import client_channel

    found = re.search(r"--supervisor (\S+) --tls-dir (\S+)", "".join(lines))
    with client_channel(found.group(1), found.group(2)) as ch:
        return next(p for p in pb_grpc.SupervisorStub(ch).Pools(pb.PoolsRequest(), timeout=5).pools if p.pool == pool)


def test_killing_up_leaves_no_process(tmp_path):
    proc, gateway, _ = start_up(tmp_path)
    assert len(processes_in(tmp_path)) >= 8  # up, redis, kvstore, router, 3 workers, gateway
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while processes_in(tmp_path):
        assert time.monotonic() < deadline, f"orphans left: {processes_in(tmp_path)}"
        time.sleep(0.1)
