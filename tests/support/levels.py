"""Kernel ISA levels for tests: every level of ISA_LEVELS is a parameter, run by forcing it (MESHSERVE_ISA, read by
the kernel factories at each call) and skipped, with the reason, where this host cannot execute it; so a run on any
one machine checks the paths the others will take, and what it cannot check is listed (pytest -rs), never passed."""

from __future__ import annotations

import os
from functools import cache

import pytest

from services.engine.layers.kernels import (
    ISA_LEVELS,
    ISA_NEEDS,
    build_every_level,
    cpu_flags,
    host_flags,
    supported_isas,
)


def why_not(level: str) -> str:
    """Why this host cannot run level ("" where it can)."""
    if level in supported_isas(host_flags()):
        return ""
    lacking = ISA_NEEDS[level] - cpu_flags()
    if not lacking:
        return f"{level}: this CPU has AMX but Linux does not grant this process the tiles"
    return f"{level}: this CPU lacks {' '.join(sorted(lacking))}"


def runnable_levels() -> list[str]:
    return [level for level in ISA_LEVELS if not why_not(level)]


@cache
def _prebuilt() -> None:
    """Every kernel at every level this host runs, built once per test run, a process per level in parallel (two
    cores build two levels at once): the tests then load what is on disk."""
    if os.environ.get("MESHSERVE_KERNELS") != "0":
        build_every_level(runnable_levels())


def force_level(level: str, monkeypatch) -> str:
    """Run the rest of the test at level: skipped with the reason where this host cannot."""
    reason = why_not(level)
    if reason:
        pytest.skip(reason)
    _prebuilt()
    monkeypatch.setenv("MESHSERVE_ISA", level)
    return level


def built(factory, level: str):
    """The kernel `factory` at level, which must have built (skipped where the kernels are off or the host cannot
    run the level)."""
    reason = why_not(level)
    if reason:
        pytest.skip(reason)
    _prebuilt()
    module = factory(level)
    if module is None and os.environ.get("MESHSERVE_KERNELS") == "0":
        pytest.skip("kernels disabled by MESHSERVE_KERNELS=0")
    assert module is not None, f"the {level} build failed (see the logged warning)"
    return module
