"""deploy/k8s (a kustomize base and the cpu and gpu overlays), built here without the binary (tests/support/
kustomize.py) and checked against the Kubernetes API's models (the official client's) and against the code:
commands and flags, environment, ports, gRPC probes and Services, the autoscaler's RBAC against the calls its
actuator makes, the network policy, disruption budgets, drain time, non-root pods with resource requests."""

import re
from pathlib import Path

import pytest

from services.autoscaler.__main__ import DEFAULT_PORT as AUTOSCALER_PORT
from services.autoscaler.__main__ import parse_workloads
from services.common import rpc
from tests.support.deploy import ROOT, command_problems, read_by_code
from tests.support.kustomize import build, check, containers, pod_spec

OVERLAYS = ["cpu", "gpu"]
K8S = ROOT / "deploy" / "k8s"


def built(overlay: str) -> list[dict]:
    return build(K8S / "overlays" / overlay)


def named(objects, kind: str) -> dict:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects) -> list[dict]:
    return [o for o in objects if pod_spec(o) is not None]


def ours(objects) -> list[tuple[dict, dict]]:
    """(workload, container) for every container that runs the meshserve image."""
    return [(w, c) for w in workloads(objects) for c in containers(w) if c["image"].startswith("meshserve:")]


def flag(command: list, name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_api_models(overlay):
    objects = built(overlay)
    assert len({(o["kind"], o["metadata"]["name"]) for o in objects}) == len(objects)  # no duplicates
    for obj in objects:
        check(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "meshserve"
    with pytest.raises(ValueError, match="replcas"):  # and the check does refuse a wrong field
        check({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {"replcas": 1}})
    with pytest.raises(ValueError, match="selector"):  # or a missing required one
        check({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
               "spec": {"template": {"spec": {"containers": []}}}})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_flags_and_environment_match_the_code(overlay):
    objects = built(overlay)
    seen = set()
    for workload, c in ours(objects):
        assert not command_problems(c["command"]), (workload["metadata"]["name"], command_problems(c["command"]))
        seen.add(c["command"][2] if c["command"][0] == "python" else "meshserve")
        env = {e["name"]: e for e in c.get("env", [])}
        for name in env:
            referenced = any(f"$({name})" in str(other.get("value", "")) for other in env.values())
            assert read_by_code(name) or referenced, f"{workload['metadata']['name']}: nothing reads {name}"
    assert {"services.gateway", "services.router", "services.kvstore", "services.worker", "services.autoscaler",
            "meshserve"} <= seen


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_probes_and_services_agree(overlay):
    objects = built(overlay)
    services = named(objects, "Service")
    defaults = {"services.gateway": rpc.DEFAULT_PORTS["gateway"], "services.router": rpc.DEFAULT_PORTS["router"],
                "services.kvstore": rpc.DEFAULT_PORTS["kvstore"], "services.autoscaler": AUTOSCALER_PORT}
    for workload, c in ours(objects):
        if c in pod_spec(workload).get("initContainers", []):
            continue
        command, port = c["command"], int(flag(c["command"], "--port"))
        if command[2] in defaults:
            assert port == defaults[command[2]], command[2]
        assert port in [p["containerPort"] for p in c["ports"]]
        for probe in ("readinessProbe", "livenessProbe"):  # gRPC health on the service's own port
            assert c[probe]["grpc"]["port"] == port, (workload["metadata"]["name"], probe)
        env = {e["name"]: e for e in c["env"]}
        assert env["MESHSERVE_HOST"]["value"] == "0.0.0.0"
        for token in command:  # every service:port it dials is a Service that reaches a pod listening there
            m = re.fullmatch(r"(?:redis://)?([a-z-]+):(\d+)(?:/0)?", token)
            if m and m.group(1) in services:
                target = services[m.group(1)]
                entry = next(p for p in target["spec"]["ports"] if p["port"] == int(m.group(2)))
                backends = [w for w in workloads(objects) if all(
                    w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in
                    target["spec"]["selector"].items())]
                assert backends, f"{token}: the Service selects no pod"
                listening = [p["containerPort"] for b in backends for k in containers(b, init=False)
                             for p in k.get("ports", [])]
                assert entry["targetPort"] in listening, token
            elif m:
                raise AssertionError(f"{token}: no Service named {m.group(1)}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_register_by_pod_ip_and_drain_within_their_grace(overlay):
    objects = built(overlay)
    workers = [(w, c) for w, c in ours(objects) if c["command"][2:3] == ["services.worker"]]
    assert {flag(c["command"], "--role") for _, c in workers} == {"prefill", "decode"}
    for w, c in workers:
        env = {e["name"]: e for e in c["env"]}
        assert env["MESHSERVE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "--worker-id" not in c["command"]  # replicas name themselves
        assert pod_spec(w)["terminationGracePeriodSeconds"] > float(flag(c["command"], "--grace-s"))
        model = flag(c["command"], "--model")
        assert any(i["command"][-1] == model for i in pod_spec(w)["initContainers"])  # fetched before it starts


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_autoscalers_rbac_allows_exactly_what_its_actuator_calls(overlay):
    objects = built(overlay)
    deployment = named(objects, "Deployment")["autoscaler"]
    command = pod_spec(deployment)["containers"][0]["command"]
    assert flag(command, "--actuator") == "kubernetes"
    targets = parse_workloads(flag(command, "--k8s-workloads"))
    kinds = {o["metadata"]["name"]: o["kind"] for o in workloads(objects)}
    for pool in flag(command, "--scaled-pools").split(","):
        kind, name = targets[pool]
        assert kinds.get(name) == kind, f"{pool}: no {kind} named {name}"
    # what the actuator calls for each workload, as RBAC resources and verbs
    needed = {(*rbac_of(call), name) for kind, name in targets.values() for call in actuator_calls(kind)}
    assert len(needed) == 2 * len(targets)
    role = named(objects, "Role")["meshserve-autoscaler"]
    granted = {(res, verb, name) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]
               for name in rule.get("resourceNames", ["*"])}
    assert needed <= granted
    for rule in role["rules"]:  # nothing wider: only the workloads' status and scale, by name, in apps
        assert rule["apiGroups"] == ["apps"] and rule.get("resourceNames")
        assert all(res.endswith(("/status", "/scale")) for res in rule["resources"])
        assert set(rule["verbs"]) <= {"get", "patch"} and "*" not in rule["verbs"]
    binding = named(objects, "RoleBinding")["meshserve-autoscaler"]
    assert binding["roleRef"]["name"] == "meshserve-autoscaler"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod_spec(deployment)["serviceAccountName"]}]
    assert named(objects, "ServiceAccount").get(pod_spec(deployment)["serviceAccountName"])


def actuator_calls(kind: str) -> tuple:
    """The client methods the Kubernetes actuator calls for a workload kind (their names)."""
    from services.mesh.actuators import KubernetesActuator

    class Apps:
        def __getattr__(self, name):
            return name

    actuator = KubernetesActuator.__new__(KubernetesActuator)
    actuator.apps = Apps()
    return actuator._calls(kind)


def rbac_of(call: str) -> tuple[str, str]:
    """read_namespaced_stateful_set_status -> (statefulsets/status, get): the resource and verb a call needs."""
    verb, _, rest = call.partition("_namespaced_")
    kind, _, sub = rest.rpartition("_")
    return f"{kind.replace('_', '')}s/{sub}", {"read": "get", "patch": "patch"}[verb]


def test_the_actuator_calls_map_to_the_resources_the_role_names():
    assert [rbac_of(c) for c in actuator_calls("Deployment")] == [("deployments/status", "get"),
                                                                 ("deployments/scale", "patch")]
    assert [rbac_of(c) for c in actuator_calls("StatefulSet")] == [("statefulsets/status", "get"),
                                                                  ("statefulsets/scale", "patch")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_is_reachable_from_outside_and_workers_keep_one_up(overlay):
    objects = built(overlay)
    policies = named(objects, "NetworkPolicy").values()
    open_to_all = [p for p in policies for rule in p["spec"]["ingress"] if "from" not in rule]
    assert [p["spec"]["podSelector"] for p in open_to_all] == [{"matchLabels": {"app": "gateway"}}]
    gateway_ports = {p["port"] for p in open_to_all[0]["spec"]["ingress"][0]["ports"]}
    assert gateway_ports == {rpc.DEFAULT_PORTS["gateway"], 8000}
    everything = [p for p in policies if p["spec"]["podSelector"] == {}]
    assert everything and everything[0]["spec"]["ingress"] == [{"from": [{"podSelector": {}}]}]
    worker_apps = {w["spec"]["template"]["metadata"]["labels"]["app"] for w, c in ours(objects)
                   if c["command"][2:3] == ["services.worker"]}
    budgets = named(objects, "PodDisruptionBudget").values()
    assert {b["spec"]["selector"]["matchLabels"]["app"] for b in budgets} == worker_apps
    assert all(b["spec"]["minAvailable"] >= 1 for b in budgets)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_non_root_with_requests(overlay):
    for w, c in ours(built(overlay)):
        assert pod_spec(w)["securityContext"]["runAsNonRoot"] is True
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]


def test_the_gpu_overlay_places_decode_as_tensor_parallel_groups():
    objects = built("gpu")
    assert "decode" not in named(objects, "Deployment")
    group = named(objects, "StatefulSet")["decode-tp"]
    c = pod_spec(group)["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and c["image"] == "meshserve:cuda"
    assert flag(c["command"], "--role") == "decode"
    spread = pod_spec(group)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"  # one pool's groups over nodes
    assert named(objects, "Service")["decode-tp"]["spec"]["clusterIP"] == "None"
    assert all(c["image"] == "meshserve:latest" for _, c in ours(built("cpu")))


def test_the_cpu_overlay_runs_decode_as_one_pod_per_tensor_parallel_group():
    """Each decode pod is a group of 2 ranks x 2 threads: it asks for exactly ranks x threads cores (the scheduler
    places the group whole on one node) and the engine section validates the sizes."""
    from services.config.engine import EngineSection

    objects = built("cpu")
    c = pod_spec(named(objects, "Deployment")["decode"])["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    engine = EngineSection(tensor_parallel_size=int(env["MESHSERVE_ENGINE__TENSOR_PARALLEL_SIZE"]),
                           threads=int(env["MESHSERVE_ENGINE__THREADS"]))
    assert engine.tensor_parallel_size == 2
    assert int(c["resources"]["requests"]["cpu"]) == engine.tensor_parallel_size * engine.threads


def test_the_mesh_file_in_the_config_map_validates():
    import yaml

    from services.config.sections import MeshConfig

    config = named(built("cpu"), "ConfigMap")["meshserve-config"]
    cfg = MeshConfig.model_validate(yaml.safe_load(config["data"]["mesh.yaml"]))
    assert cfg.pool_role("decode") == "decode"
    assert Path(K8S / "base" / "kustomization.yaml").exists()
