"""The container check: the mesh of deploy/docker-compose.yml in real containers, driven as a user would.

    python scripts/compose_check.py [--local] [--out RESULT.json]     # scripts/compose-check.sh sets it up first

1. `docker compose up -d`; ready when the gateway's HTTP port answers /v1/models (time to ready reported);
2. a chat completion through the published HTTP port: SmolLM2 answers "Paris";
3. one request's trace reached the OTLP receiver with spans from gateway, router, prefill, kvstore and decode;
4. `--scale decode=3`: three decode containers, each seen serving (decode spans from three container hostnames);
   with --local, Prometheus scrapes the /metrics of all seven service containers;
5. `docker kill` of a decode container with streams in flight: every stream completes (the mesh resumes them,
   issue 19), and `compose up --scale` starts it again; a crash (its process killed from the host) is restarted
   by the restart policy;
6. `docker compose down -v`: nothing of the project is left;
7. the image on CPUs of lower levels than this one: with MESHSERVE_ISA forcing each level below this CPU's, a
   container generates from the model volume in bfloat16 with the kernels built into the image at that level (the
   prompt kernel's path for the level), compiling nothing.

--local adds deploy/docker-compose.local.yml (no image registry: docs/OPERATIONS.md). Ports are free ones.
Exits non-zero on the first check that fails, after `down`, with the compose logs of the project's services.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"gateway", "router", "prefill", "kvstore", "decode"}
QUESTION = "What is the capital of France? Answer with one word."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step(msg: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class _Done(Exception):
    """The autoscaler run ends after its own step."""


class Check:
    def __init__(self, local: bool, project: str, autoscaler: bool = False):
        self.files = ["-f", str(ROOT / "deploy/docker-compose.yml")]
        if local:
            self.files += ["-f", str(ROOT / "deploy/docker-compose.local.yml")]
        if autoscaler:
            self.files += ["--profile", "autoscaler"]
        self.project = project
        self.http, self.grpc, self.traces, self.prom = free_port(), free_port(), free_port(), free_port()
        self.env = {**os.environ, "MESHSERVE_HTTP_PORT": str(self.http), "MESHSERVE_GRPC_PORT": str(self.grpc),
                    "MESHSERVE_TRACES_PORT": str(self.traces), "MESHSERVE_PROMETHEUS_PORT": str(self.prom),
                    "MESHSERVE_DEPLOY_DIR": str(ROOT / "deploy")}  # the autoscaler runs Compose on it
        if os.environ.get("DOCKER_HOST", "").startswith("unix://"):  # the engine's socket, for the autoscaler
            self.env["MESHSERVE_DOCKER_SOCKET"] = os.environ["DOCKER_HOST"].removeprefix("unix://")
        self.result: dict = {"project": project, "local_override": local}
        self.model = ""

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> str:
        done = subprocess.run(["docker", "compose", *self.files, "-p", self.project, *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)} failed ({done.returncode}): {done.stderr[-3000:]}")
        return done.stdout

    def containers(self, service: str) -> list[dict]:
        out = self.compose("ps", "--format", "json", service)
        rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
        if len(rows) == 1 and isinstance(rows[0], list):
            rows = rows[0]
        return rows

    # ---- HTTP ---------------------------------------------------------------------------------------

    def get(self, port: int, path: str, timeout: float = 10) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return json.loads(r.read())

    def chat(self, content: str, max_tokens: int = 16, stream: bool = False, ignore_eos: bool = False,
             on_chunk=None) -> dict:
        """One chat completion; with stream, the text and the chunks' count, read as they arrive."""
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=300)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"chat: HTTP {r.status}: {r.read()[:500]!r}")
        if not stream:
            reply = json.loads(r.read())
            return {"text": reply["choices"][0]["message"]["content"], "tokens": reply["usage"]["completion_tokens"],
                    "finish": reply["choices"][0]["finish_reason"]}
        text, chunks, finish, tokens = [], 0, None, None
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    text.append(delta)
                    chunks += 1
                    if on_chunk is not None:
                        on_chunk(chunks)
                finish = choice.get("finish_reason") or finish
        return {"text": "".join(text), "chunks": chunks, "finish": finish, "tokens": tokens}

    # ---- the steps ----------------------------------------------------------------------------------

    def up(self) -> None:
        step(f"docker compose up -d (project {self.project}; HTTP on :{self.http}, traces on :{self.traces})")
        t0 = time.monotonic()
        self.compose("up", "-d")
        deadline = t0 + 900
        while True:
            try:
                models = self.get(self.http, "/v1/models", timeout=5)["data"]
                if models:
                    self.model = models[0]["id"]
                    self.chat("Hi", max_tokens=1)  # a worker of each role is registered and serves
                    break
            except (OSError, RuntimeError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the mesh did not become ready in 900 s")
            time.sleep(2)
        self.result["ready_s"] = round(time.monotonic() - t0, 1)
        step(f"ready in {self.result['ready_s']} s, serving {self.model}")

    def paris(self) -> None:
        reply = self.chat(QUESTION, max_tokens=16)
        step(f"chat: {QUESTION!r} -> {reply['text']!r}")
        if "paris" not in reply["text"].lower():
            raise RuntimeError(f"expected Paris, got {reply['text']!r}")
        self.result["paris"] = reply["text"]

    def spans(self, service: str | None = None, limit: int = 100_000) -> list[dict]:
        query = f"?limit={limit}" + (f"&service={service}" if service else "")
        return self.get(self.traces, "/api/spans" + query)["data"]

    def one_trace(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            spans = self.spans()
            by_trace: dict[str, set] = {}
            for s in spans:
                by_trace.setdefault(s["trace_id"], set()).add(s["service"])
            whole = [t for t, seen in by_trace.items() if seen >= SERVICES]
            if whole:
                trace = self.get(self.traces, f"/api/traces/{whole[-1]}")["data"]
                self.result["trace"] = {"trace_id": whole[-1], "spans": len(trace),
                                        "services": sorted({s["service"] for s in trace})}
                step(f"trace {whole[-1]}: {len(trace)} spans from {', '.join(self.result['trace']['services'])}")
                return
            if time.monotonic() > deadline:
                best = max(by_trace.values(), key=len, default=set())
                raise RuntimeError(f"no trace with spans from all of {sorted(SERVICES)}; the fullest: {sorted(best)}")
            time.sleep(2)

    def wait_healthy(self, service: str, n: int, timeout: float = 600) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            rows = [r for r in self.containers(service) if r.get("State") == "running"
                    and r.get("Health", "healthy") in ("healthy", "")]
            if len(rows) >= n:
                return rows
            if time.monotonic() > deadline:
                raise RuntimeError(f"{service}: {len(rows)} of {n} containers healthy after {timeout:.0f} s")
            time.sleep(2)

    def scale(self) -> None:
        step("docker compose up -d --scale decode=3")
        t0 = time.monotonic()
        self.compose("up", "-d", "--scale", "decode=3", "--no-recreate", "decode")
        rows = self.wait_healthy("decode", 3)
        self.result["scale_to_3_healthy_s"] = round(time.monotonic() - t0, 1)
        hosts = {r["ID"][:12] for r in rows}
        step(f"3 decode containers healthy in {self.result['scale_to_3_healthy_s']} s: {sorted(hosts)}")
        before = {s["span_id"] for s in self.spans("decode")}
        seen: set = set()
        for _ in range(10):  # rounds of concurrent requests until each decode container has served some
            with ThreadPoolExecutor(12) as pool:
                list(pool.map(lambda i: self.chat(f"Count from {i} to {i + 20}.", max_tokens=24), range(12)))
            time.sleep(1.5)  # the spans' export interval
            seen = {s["host"] for s in self.spans("decode") if s["span_id"] not in before}
            if hosts <= {h[:12] for h in seen if h}:
                break
        served = sorted(h[:12] for h in seen if h)
        self.result["decode_hosts_serving"] = served
        step(f"decode containers seen serving: {served}")
        if not hosts <= set(served):
            raise RuntimeError(f"not every decode container served: {sorted(hosts)} against {served}")

    def prometheus(self) -> None:
        """Local override only: Prometheus scrapes every service's /metrics, each replica found by DNS."""
        deadline = time.monotonic() + 90
        while True:
            try:
                rows = self.get(self.prom, "/api/v1/query?query=up")["data"]["result"]
            except (OSError, KeyError, ValueError):
                rows = []
            up = sorted(r["metric"]["instance"] for r in rows if r["value"][1] == "1")
            if len(up) >= len(SERVICES) + 2:  # three decode containers
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus scrapes {len(up)} targets up: {up}")
            time.sleep(3)
        self.result["prometheus_targets_up"] = len(up)
        step(f"Prometheus: {len(up)} /metrics targets up ({', '.join(up)})")

    def kill_one(self) -> None:
        streams, max_tokens = 24, 160
        results: list = [None] * streams
        progress = [0] * streams

        def one(i: int) -> None:
            def seen(n: int) -> None:
                progress[i] = n

            try:
                results[i] = self.chat(f"Write a long story about the number {i}.", max_tokens=max_tokens,
                                       stream=True, ignore_eos=True, on_chunk=seen)
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                results[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while min(progress) < 1 and time.monotonic() < deadline:  # every stream admitted and decoding
            time.sleep(0.1)
        victim = self.containers("decode")[0]
        in_flight = sum(1 for r in results if r is None)
        step(f"{in_flight} of {streams} streams in flight ({min(progress)}-{max(progress)} of {max_tokens} chunks "
             f"so far); docker kill {victim['Name']}")
        subprocess.run(["docker", "kill", victim["ID"]], check=True, capture_output=True, timeout=60, env=self.env)
        for t in threads:
            t.join(timeout=600)
        failed = [(i, r) for i, r in enumerate(results)
                  if not isinstance(r, dict) or r["tokens"] != max_tokens or r["finish"] != "length"]
        resumed = sum("resuming after" in line for line in self.compose("logs", "--no-color", "gateway").splitlines())
        self.result["kill"] = {"streams": streams, "in_flight_at_kill": in_flight, "resumed_by_gateway": resumed,
                               "completed": streams - len(failed), "killed": victim["Name"]}
        step(f"after the kill: {streams - len(failed)} of {streams} streams completed with {max_tokens} tokens; "
             f"the gateway resumed {resumed} of them on another decode container")
        # in flight: every stream but any that an early admission let finish before the last was admitted (the
        # gateway admits as slots free; one stream once ran its 160 tokens before the slowest had 8)
        if failed or in_flight < streams // 2 or not resumed:
            raise RuntimeError(f"in flight at the kill: {in_flight}, resumed: {resumed}; streams that did not "
                               f"complete: {failed[:5]}")
        # `docker kill` is a user's stop to the engine (Docker and Podman alike): no restart policy fires. Compose
        # brings the service back to its scale.
        t0 = time.monotonic()
        self.compose("up", "-d", "--scale", "decode=3", "--no-recreate", "decode")
        self.wait_healthy("decode", 3)
        self.result["kill"]["compose_restart_healthy_s"] = round(time.monotonic() - t0, 1)
        step(f"compose up --scale decode=3 started it again: 3 healthy in "
             f"{self.result['kill']['compose_restart_healthy_s']} s")
        self.crash()
        self.paris()

    def crash(self) -> None:
        """A crash, not a stop: the container's process killed with SIGKILL from the host (as the OOM killer
        would); the restart policy (unless-stopped) brings it back. Only where this host runs the containers."""
        victim = self.containers("decode")[-1]
        state = self.inspect(victim["ID"])
        pid, restarts = state["State"].get("Pid", 0), state.get("RestartCount", 0)
        if not pid or not Path(f"/proc/{pid}").exists():
            step("crash: the engine's processes are not visible from here; skipped")
            return
        step(f"crash: kill -9 of {victim['Name']}'s process {pid} from the host")
        os.kill(pid, 9)
        t0 = time.monotonic()
        while True:
            state = self.inspect(victim["ID"])
            if state["State"].get("Running") and state["State"].get("Pid") != pid:
                break
            if time.monotonic() - t0 > 120:
                raise RuntimeError(f"{victim['Name']} was not restarted after a crash: {state['State']}")
            time.sleep(1)
        self.wait_healthy("decode", 3)
        self.result["crash_restart_healthy_s"] = round(time.monotonic() - t0, 1)
        step(f"restarted by its restart policy (restarts {restarts} -> {state.get('RestartCount')}), healthy "
             f"in {self.result['crash_restart_healthy_s']} s")

    def inspect(self, container: str) -> dict:
        out = subprocess.run(["docker", "inspect", container], capture_output=True, text=True, env=self.env,
                             timeout=60).stdout
        return json.loads(out or "[{}]")[0]

    def kv_hop(self, mb: int) -> None:
        """bench/kv_hop.py between containers: a probe container puts and gets KV blocks through the kvstore
        container over gRPC, and copies the same bytes over raw TCP to a sink container (a third network host)."""
        network = f"{self.project}_default"
        image = self.env.get("MESHSERVE_IMAGE", "meshserve:latest")
        sink = f"{self.project}-kvsink"
        subprocess.run(["docker", "rm", "-f", sink], capture_output=True, env=self.env, timeout=60)
        subprocess.run(["docker", "run", "-d", "--name", sink, "--network", network, image, "python", "-m",
                        "bench.kv_hop", "sink", "--port", "7000"], check=True, capture_output=True, env=self.env,
                       timeout=120)
        try:
            time.sleep(3)
            step(f"KV hop across containers: {mb} MB put and get through kvstore:50053, raw TCP to {sink}")
            out = subprocess.run(["docker", "run", "--rm", "--network", network, image, "python", "-m", "bench.kv_hop",
                                  "probe", "--kvstore", "kvstore:50053", "--sink", f"{sink}:7000", "--mb", str(mb)],
                                 check=True, capture_output=True, text=True, env=self.env, timeout=900).stdout
        finally:
            subprocess.run(["docker", "rm", "-f", sink], capture_output=True, env=self.env, timeout=60)
        runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        self.result["kv_hop"] = runs
        for r in runs:
            step(f"  put {r['kv_put_gbytes_per_s']} GB/s, get {r['kv_get_gbytes_per_s']} GB/s, raw TCP copy "
                 f"{r['socket_copy_gbytes_per_s']} GB/s")

    def lower_levels(self) -> None:
        """The image as a machine of a lower ISA level runs it: MESHSERVE_ISA forces each level this CPU runs below
        its own widest; a container generates from the project's model volume in bfloat16 (the prompt kernel's
        path for that level), its start-up lines name the level, and no kernel is built (the image carries every
        level's objects)."""
        sys.path.insert(0, str(ROOT))
        from services.engine.layers.kernels import cpu_flags, supported_isas

        image = self.env.get("MESHSERVE_IMAGE", "meshserve:latest")
        volume = self.env.get("MESHSERVE_MODELS") or f"{self.project}_models"
        model = f"/models/{self.env.get('MESHSERVE_MODEL', 'smollm2-135m-instruct')}"
        request = json.dumps({"id": "a", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        script = (f"echo '{request}' > /tmp/in.jsonl && meshserve generate --model {model} --dtype bfloat16 "
                  "--input /tmp/in.jsonl --output /tmp/o.jsonl && cat /tmp/o.jsonl")
        self.result["lower_levels"] = {}
        for level in supported_isas(cpu_flags())[1:]:
            t0 = time.monotonic()
            run = subprocess.run(["docker", "run", "--rm", "-v", f"{volume}:/models:ro", "-e", f"MESHSERVE_ISA={level}",
                                  image, "sh", "-c", script], capture_output=True, text=True, env=self.env, timeout=600)
            said = [ln for ln in run.stderr.splitlines() if ln.startswith(("kernels at level", "attention ("))]
            prompts = "torch's SDPA" if level == "generic" else "prompts compiled kernel"
            if run.returncode != 0 or f"kernels at level {level} " not in run.stderr or prompts not in run.stderr \
                    or "building the" in run.stderr or "Paris" not in run.stdout:
                raise RuntimeError(f"the image at {level}: exit {run.returncode}\n{run.stdout[-500:]}\n"
                                   f"{run.stderr[-3000:]}")
            self.result["lower_levels"][level] = round(time.monotonic() - t0, 1)
            step(f"MESHSERVE_ISA={level}: 'The capital of France is' -> {json.loads(run.stdout)['text']!r} in "
                 f"{self.result['lower_levels'][level]} s, nothing built; {said[-1] if said else ''}")

    def autoscale(self, seconds: float = 240) -> None:
        """--profile autoscaler: a burst of long streams against one decode container; the autoscaler (its
        Compose actuator, through the engine's socket) adds decode containers, which register and serve."""
        before = {r["ID"][:12] for r in self.containers("decode")}
        step(f"autoscaler: a burst of 48 concurrent streams of 256 tokens against {len(before)} decode container(s)")
        stop = threading.Event()
        done, failed = [0], []

        def client(i: int) -> None:
            while not stop.is_set():
                try:
                    r = self.chat(f"Write a long story about the number {i}.", max_tokens=256, stream=True,
                                  ignore_eos=True)
                    done[0] += r["tokens"] == 256
                except Exception as e:  # noqa: BLE001 - reported below
                    failed.append(repr(e))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(48)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        grown, serving = None, set()
        while time.monotonic() - t0 < seconds:
            rows = [r for r in self.containers("decode") if r.get("State") == "running"]
            new = {r["ID"][:12] for r in rows} - before
            if new and grown is None:
                grown = round(time.monotonic() - t0, 1)
                step(f"autoscaler: {len(rows)} decode containers after {grown} s (new: {sorted(new)})")
            serving = {s["host"][:12] for s in self.spans("decode") if s["host"]} & new
            if serving:
                break
            time.sleep(3)
        served_s = round(time.monotonic() - t0, 1)
        stop.set()
        for t in threads:
            t.join(timeout=300)
        logs = self.compose("logs", "--no-color", "autoscaler").splitlines()
        decisions = [ln.split("|", 1)[-1].strip() for ln in logs
                     if "autoscaler INFO" in ln and (" up to " in ln or " down to " in ln)]
        self.result["autoscale"] = {"first_new_container_s": grown, "new_container_serving_s": served_s if serving
                                    else None, "streams_completed": done[0], "failed": len(failed),
                                    "decisions": decisions[-5:]}
        step(f"autoscaler: a new decode container served after {served_s} s; {done[0]} streams completed, "
             f"{len(failed)} failed")
        for line in decisions[-5:]:
            step(f"  {line.strip()[:200]}")
        if not serving or failed:
            raise RuntimeError(f"the autoscaler did not add a serving decode container in {seconds:.0f} s "
                               f"(failed streams: {failed[:3]})")

    def down(self) -> None:
        step("docker compose down -v")
        self.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False)
        label = f"label=com.docker.compose.project={self.project}"
        left = subprocess.run(["docker", "ps", "-a", "-q", "--filter", label], capture_output=True, text=True,
                              env=self.env, timeout=60).stdout.split()
        self.result["left_after_down"] = len(left)
        if left:
            raise RuntimeError(f"containers left after down: {left}")
        step("nothing left")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local", action="store_true", help="add deploy/docker-compose.local.yml (no registry)")
    ap.add_argument("--project", default="meshserve-check")
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    ap.add_argument("--keep", action="store_true", help="leave the mesh running (no kill, no down)")
    ap.add_argument("--autoscaler", action="store_true",
                    help="run the autoscaler profile and check that a load burst makes it add decode containers "
                         "(in place of the scale, kill and KV steps)")
    ap.add_argument("--kv-hop", type=int, default=0, metavar="MB",
                    help="also measure the KV hop between containers with MB megabytes (bench/kv_hop.py)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("compose-check: terminated (time limit?)"))  # down still runs
    check = Check(args.local, args.project, args.autoscaler)
    ok = False
    try:
        check.compose("down", "-v", "--remove-orphans", check=False)  # a run that was cut off before
        check.up()
        check.paris()
        check.one_trace()
        if args.autoscaler:
            check.autoscale()
            args.keep, args.kv_hop = False, 0
            raise _Done
        check.scale()
        if args.local:
            check.prometheus()
        if args.kv_hop:
            check.kv_hop(args.kv_hop)
        if not args.keep:
            check.kill_one()
        check.lower_levels()
        ok = True
    except _Done:
        ok = True
    except (Exception, SystemExit) as e:  # noqa: BLE001 - reported with the services' logs, then down
        step(f"FAILED: {e}")
        print(check.compose("logs", "--no-color", "--tail", "60", check=False)[-20000:], flush=True)
    finally:
        if not args.keep:
            try:
                check.down()
            except Exception as e:  # noqa: BLE001
                step(f"FAILED: {e}")
                ok = False
    if args.out:
        Path(args.out).write_text(json.dumps(check.result, indent=1) + "\n")
    step("passed" if ok else "failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
