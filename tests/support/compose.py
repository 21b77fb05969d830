"""deploy/docker-compose.yml as the tests read it: variables substituted as Compose does, our image's services."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(node, env: dict):
    """${VAR} and ${VAR:-default} as Compose substitutes them (from the environment or deploy/.env)."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, str):
        return VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), node)
    return node


@cache
def compose() -> dict:
    return interpolate(yaml.safe_load((DEPLOY / "docker-compose.yml").read_text()), {})


def ours() -> dict:
    """Services that run our image (the others are Redis, Jaeger, the collector)."""
    raw = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return {name: compose()["services"][name] for name, s in raw["services"].items()
            if s.get("build", {}).get("dockerfile") == "Dockerfile"}


def flag_value(command: list, flag: str) -> str:
    return command[command.index(flag) + 1]
