"""Checks of deployment files against the code, shared by the Compose and Kubernetes tests: a service's command
exists and takes the flags it is given; the environment variables the code reads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@cache
def help_text(module: str, *words: str) -> str:
    done = subprocess.run([sys.executable, "-m", module, *words, "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "MESHSERVE_CONFIG": ""})
    assert done.returncode == 0, done.stderr
    return done.stdout


def command_problems(command: list) -> list[str]:
    """What is wrong with a container's command: not one of ours, or a flag its --help does not list."""
    if command[:2] == ["python", "-m"] and command[2].startswith("services."):
        text = help_text(command[2])
    elif command[:1] == ["meshserve"]:
        words = [w for w in command[1:] if not w.startswith("-")][:2]  # the subcommand (and its own subcommand)
        text = help_text("services.cli", *words)
    else:
        return [f"not a meshserve command: {command[:3]}"]
    return [f"{token} is not a flag" for token in command
            if token.startswith("--") and not re.search(rf"(^|\s|\[){re.escape(token)}\b", text)]


def code_variables() -> frozenset:
    """Environment variables the code reads: the registry of services/common/envs.py (tests/unit/test_envs.py
    checks that the code reads none outside it)."""
    from services.common.envs import REGISTRY

    return frozenset(REGISTRY)


def read_by_code(name: str) -> bool:
    """The code reads it: a variable of code_variables(), one the OpenTelemetry SDK reads (OTEL_*), or a key of
    the config's environment layer (MESHSERVE_<SECTION>__<KEY>, with a real section and key)."""
    from services.common.envs import CONFIG_PREFIX
    from services.config.sections import MeshConfig

    if name in code_variables() or name.startswith("OTEL_"):
        return True
    section, _, field = name.removeprefix(CONFIG_PREFIX).lower().partition("__")
    model = MeshConfig.model_fields.get(section) if name.startswith(CONFIG_PREFIX) and field else None
    return model is not None and field in model.annotation.model_fields


