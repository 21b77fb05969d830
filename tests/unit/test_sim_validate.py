"""sim-validate's comparison of repeated real runs, through --replay of runs kept on disk (no mesh): the figures
compared are each metric's median over the runs, beside how far the real runs came apart."""

import json

import pytest

from bench.sim_validate import _keep, _run_dir
from services.cli import main
from sim.cluster import ClusterSpec
from sim.cost import CostModel
from sim.trace import TraceRequest
from sim.worker import WorkerSpec

METRICS = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "output_tokens_per_s")


def _real(scale: float, completed: int, rejected: int) -> dict:
    figures = dict(zip(METRICS, (50.0, 120.0, 10.0, 14.0, 400.0)))
    return {**{m: v * scale for m, v in figures.items()}, "completed": completed, "requests": 10,
            "failed_by_status": {"RESOURCE_EXHAUSTED": rejected} if rejected else {}}


def _kept_runs(folder, reals: list) -> None:
    CostModel().save(folder / "cost.json")
    cluster = ClusterSpec(mode="unified", workers=1, worker=WorkerSpec(num_blocks=512), admission="none")
    trace = [TraceRequest(arrival_s=0.1 * i, prompt_tokens=64 + 8 * i, output_tokens=16, id=f"r{i}")
             for i in range(10)]
    for i, real in enumerate(reals):
        _keep(_run_dir(folder, "mesh-mixed", i), real, trace, cluster, [], {"requests": 10}, [])


def test_repeated_real_runs_compare_by_their_medians_beside_their_spread(tmp_path):
    _kept_runs(tmp_path, [_real(1.0, 10, 0), _real(2.0, 8, 2), _real(1.2, 9, 1)])
    out = tmp_path / "result.json"
    assert main(["bench", "sim-validate", "--replay", str(tmp_path), "--validate", "mesh-mixed",
                 "--model", str(tmp_path), "--out", str(out)]) == 0
    got = json.loads(out.read_text())["systems"]["mesh-mixed"]
    assert got["runs"] == 3 and len(got["per_run"]) == 3
    base = _real(1.0, 0, 0)
    for m in METRICS:
        assert got["real"][m] == pytest.approx(base[m] * 1.2)  # the median of x1.0, x2.0, x1.2
        assert got["real_spread"][m] == pytest.approx(1.0)  # x2.0 over x1.0
        assert got["sim_spread"][m] == 0.0  # one trace, one simulation: the same figures every run
        assert got["error"][m] == pytest.approx(got["sim"][m] / got["real"][m] - 1, abs=1e-4)
        assert [r["real"][m] for r in got["per_run"]] == pytest.approx([base[m] * k for k in (1.0, 2.0, 1.2)])
    assert got["real"]["completed"] == 9 and got["real"]["failed_by_status"] == {"RESOURCE_EXHAUSTED": 1}


def test_one_kept_run_is_compared_as_it_is(tmp_path):
    _kept_runs(tmp_path, [_real(1.0, 10, 0)])
    out = tmp_path / "result.json"
    assert main(["bench", "sim-validate", "--replay", str(tmp_path), "--validate", "mesh-mixed",
                 "--model", str(tmp_path), "--out", str(out)]) == 0
    got = json.loads(out.read_text())["systems"]["mesh-mixed"]
    assert "runs" not in got and got["real"]["ttft_ms_p50"] == 50.0


def test_replay_of_a_folder_without_kept_runs_says_so(tmp_path, capsys):
    CostModel().save(tmp_path / "cost.json")
    assert main(["bench", "sim-validate", "--replay", str(tmp_path), "--validate", "mesh-mixed",
                 "--model", str(tmp_path), "--out", str(tmp_path / "r.json")]) == 2
    assert "no kept run of mesh-mixed" in capsys.readouterr().err
    assert main(["bench", "sim-validate", "--replay", str(tmp_path), "--model", str(tmp_path), "--repeat", "0"]) == 2
    assert "--repeat must be 1 or more" in capsys.readouterr().err
