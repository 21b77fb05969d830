"""deploy/docker-compose.yml, its collector config and the Dockerfile, checked against the code (no container engine
here): the file is valid Compose (the specification's schema, or `docker compose config` where it exists); every
service of our image runs a command that exists, with flags its --help lists; every variable it sets is one the
code (or the OpenTelemetry SDK) reads; ports, addresses and health probes agree with the services' defaults; the
collector sends where the services listen; the image pins torch as pyproject does."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from services.autoscaler.__main__ import DEFAULT_PORT as AUTOSCALER_PORT
from services.common import rpc
from tests.support.compose import DEPLOY, ROOT, compose, flag_value, interpolate, ours
from tests.support.deploy import code_variables, command_problems, read_by_code


def test_the_compose_file_is_valid_compose():
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=60).returncode == 0:  # the real parser where it exists
        done = subprocess.run(["docker", "compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    schema = jsonschema.Draft201909Validator(json.loads((Path(__file__).parent / "schemas" /
                                                        "compose_spec.json").read_text()))
    schema.validate(compose())  # the specification's schema (draft 2019-09), after interpolation
    with pytest.raises(jsonschema.ValidationError):  # and it does refuse a wrong file
        schema.validate({"services": {"x": {"image": "a", "ports": [{"bogus": 1}]}}})


def test_every_command_exists_with_the_flags_it_is_given():
    commands = {name: service["command"] for name, service in ours().items()}
    assert len(commands) >= 7  # model, kvstore, router, prefill, decode, gateway, autoscaler
    for name, command in commands.items():
        assert not command_problems(command), (name, command_problems(command))


def test_every_variable_the_file_sets_is_one_the_code_reads():
    assert {"MESHSERVE_HOST", "MESHSERVE_CONFIG", "MESHSERVE_ADVERTISE_HOST", "MESHSERVE_TOPOLOGY"} <= code_variables()
    assert read_by_code("MESHSERVE_ENGINE__THREADS") and not read_by_code("MESHSERVE_ENGINE__THREADZ")
    text = (DEPLOY / "docker-compose.yml").read_text()
    for name, service in ours().items():
        for var in service.get("environment", {}):
            # the autoscaler also passes on variables the file substitutes: its own Compose reads them
            assert read_by_code(var) or (name == "autoscaler" and "${" + var in text), f"{name}: nothing reads {var}"
    from services.common.envs import CONFIG_PREFIX

    assert CONFIG_PREFIX == "MESHSERVE_"
    example = [ln.split("=", 1)[0] for ln in (DEPLOY / ".env.example").read_text().splitlines()
               if ln and not ln.startswith("#")]
    text = (DEPLOY / "docker-compose.yml").read_text()
    for var in example:  # every variable of the example is substituted somewhere in the file
        assert "${" + var in text, f".env.example: {var} is used nowhere in docker-compose.yml"


def test_ports_addresses_and_probes_agree_with_the_services():
    s = ours()
    expected = {"gateway": rpc.DEFAULT_PORTS["gateway"], "router": rpc.DEFAULT_PORTS["router"],
                "kvstore": rpc.DEFAULT_PORTS["kvstore"], "autoscaler": AUTOSCALER_PORT}
    for name, port in expected.items():
        assert flag_value(s[name]["command"], "--port") == str(port), name
    for name, service in s.items():
        if "healthcheck" in service:  # the probe asks the service's own port, through `meshserve health`
            probe = service["healthcheck"]["test"]
            assert probe[:3] == ["CMD", "meshserve", "health"]
            assert probe[3] == f"127.0.0.1:{flag_value(service['command'], '--port')}", name
    assert {"gateway", "router", "kvstore", "prefill", "decode"} <= {n for n, v in s.items() if "healthcheck" in v}
    for name in ("prefill", "decode", "gateway"):  # they reach the router and the kvstore where those listen
        assert flag_value(s[name]["command"], "--router") == f"router:{expected['router']}"
    assert flag_value(s["gateway"]["command"], "--kvstore") == f"kvstore:{expected['kvstore']}"
    for name in ("kvstore", "router", "prefill", "decode"):
        assert flag_value(s[name]["command"], "--redis-url") == "redis://redis:6379/0"
    published = {p.split(":")[1] for p in s["gateway"]["ports"]}
    assert published == {str(expected["gateway"]), flag_value(s["gateway"]["command"], "--http-port")}
    # workers: no fixed replica count, no fixed name or address (each registers under its container's hostname)
    for name in ("prefill", "decode"):
        command = s[name]["command"]
        assert "--worker-id" not in command and "container_name" not in s[name] and "hostname" not in s[name]
        assert flag_value(command, "--role") == name and s[name]["environment"]["MESHSERVE_HOST"] == "0.0.0.0"
        assert flag_value(command, "--model") == flag_value(s["gateway"]["command"], "--model")
    fetched = s["model"]["command"]
    assert fetched[-1] == flag_value(s["gateway"]["command"], "--model")  # the model service fills what they load
    # the autoscaler scales the file's own services, through the Compose actuator, and only with its profile
    auto = s["autoscaler"]
    assert auto["profiles"] == ["autoscaler"] and flag_value(auto["command"], "--actuator") == "compose"
    for pair in flag_value(auto["command"], "--compose-services").split(","):
        pool, service = pair.split("=")
        assert service in s and s[service]["command"][s[service]["command"].index("--role") + 1] == pool
    # it runs Compose on this folder, mounted where the file says it is, and passes on what decode substitutes
    compose_file = auto["environment"]["MESHSERVE_AUTOSCALER__COMPOSE_FILE"]
    assert compose_file == "/deploy/docker-compose.yml" and ".:/deploy:ro" in auto["volumes"]
    raw_decode = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["decode"]  # merged
    substituted = set(re.findall(r"\$\{(\w+)", json.dumps(raw_decode)))
    assert substituted and substituted <= set(auto["environment"]), substituted


def test_the_collector_sends_where_the_services_listen():
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    services = compose()["services"]
    receiving = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    for name, service in ours().items():
        endpoint = service["environment"].get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint:
            assert endpoint == f"http://otel-collector:{receiving}", name
    exporters = collector["exporters"]
    assert exporters["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert exporters["otlp/autoscaler"]["endpoint"] == f"autoscaler:{AUTOSCALER_PORT}"
    pipes = collector["service"]["pipelines"]
    assert pipes["traces"]["exporters"] == ["otlp/jaeger"]
    assert set(pipes["metrics"]["exporters"]) == {"prometheus", "otlp/autoscaler"}
    assert f"{exporters['prometheus']['endpoint'].rsplit(':', 1)[1]}:" in services["otel-collector"]["ports"][0]
    for mounted in ("./otel-collector.yaml", "./mesh.yaml"):
        assert (DEPLOY / mounted).exists()


def test_the_mesh_file_validates_and_the_image_pins_torch_as_pyproject_does():
    from services.config.loader import load_mesh_config

    cfg = load_mesh_config(str(DEPLOY / "mesh.yaml"), env={})
    assert cfg.pool_role("decode") == "decode"
    dockerfile = (ROOT / "Dockerfile").read_text()
    pinned = re.search(r'"torch==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"ARG TORCH_VERSION={pinned}" in dockerfile
    assert dockerfile.index("torch==${TORCH_VERSION}") < dockerfile.index("pip install /src")  # torch first
    assert re.search(r"^USER meshserve$", dockerfile, re.M)  # not root
    assert "download.pytorch.org/whl/cpu" in dockerfile  # the CPU build unless VARIANT=cuda
    packages = re.search(r'include = \[(.*)\]', (ROOT / "pyproject.toml").read_text()).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):  # every package the project installs is copied in
        assert f"COPY {package} /src/{package}" in dockerfile, package


def _override() -> dict:
    """deploy/docker-compose.local.yml, with Compose's merge tags (!reset, !override) read as plain values."""
    class Loader(yaml.SafeLoader):
        pass

    def plain(loader, node):
        return loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else \
            loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_scalar(node)

    for tag in ("!reset", "!override"):
        Loader.add_constructor(tag, plain)
    return yaml.load((DEPLOY / "docker-compose.local.yml").read_text(), Loader=Loader)


def test_the_local_override_swaps_only_images_this_project_builds_and_keeps_the_wiring():
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=60).returncode == 0:
        done = subprocess.run(["docker", "compose", "-f", str(DEPLOY / "docker-compose.yml"), "-f",
                               str(DEPLOY / "docker-compose.local.yml"), "config", "-q"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    local, main = _override()["services"], compose()["services"]
    assert set(local) <= set(main) | {"prometheus"}  # it adds Prometheus and changes nothing else's name
    script = (ROOT / "scripts/container-images.sh").read_text()
    for name, service in local.items():
        image = interpolate(service.get("image", ""), {})
        if image.startswith("localhost/"):  # built here from deploy/local/NAME.Dockerfile
            assert f"localhost/meshserve-{name}:bookworm" == image and (DEPLOY / f"local/{name}.Dockerfile").exists()
            assert "for name in redis prometheus" in script and name in ("redis", "prometheus")
        elif image:
            assert image == "meshserve:latest", name
    # the receiver takes the collector's place: the port the services send to, metrics on to the autoscaler
    receiver = local["otel-collector"]["command"]
    assert not command_problems(receiver), command_problems(receiver)
    endpoint = main["gateway"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint == f"http://otel-collector:{flag_value(receiver, '--port')}"
    assert flag_value(receiver, "--forward-metrics") == f"autoscaler:{AUTOSCALER_PORT}"
    assert flag_value(receiver, "--host") == "0.0.0.0"
    # Prometheus scrapes the metrics port every service is given, on every service with a health probe
    scrape = yaml.safe_load((DEPLOY / "local/prometheus.yml").read_text())["scrape_configs"][0]["dns_sd_configs"][0]
    port = main["gateway"]["environment"]["MESHSERVE_METRICS_PORT"]
    assert str(scrape["port"]) == port
    assert set(scrape["names"]) == {n for n, s in ours().items() if "healthcheck" in s and n != "autoscaler"}
