"""Side-by-side table of `vllm bench serve` results saved by vllm_bench_serve.sh (argv[1] = their folder).

Runs: inf, light (half of vLLM's measured capacity) and rate4 at the client's default sampling (temperature 1.0),
the same with -t0 greedy; with each meshserve system's count of log lines reporting a worker missing or forgotten.
"""

import json
import sys
from pathlib import Path

METRICS = [("output_throughput", "output tok/s"), ("request_throughput", "req/s"), ("median_ttft_ms", "TTFT p50 ms"),
           ("p99_ttft_ms", "TTFT p99 ms"), ("median_tpot_ms", "TPOT p50 ms"), ("p99_tpot_ms", "TPOT p99 ms"),
           ("completed", "completed")]


SYSTEMS = ("vllm", "meshserve", "meshserve-f32", "meshserve-disagg", "meshserve-default")


def main(folder: str) -> None:
    out = {}
    for run in ("inf", "light", "rate4", "inf-t0", "light-t0", "rate4-t0"):
        for system in SYSTEMS:
            path = Path(folder) / f"{system}-{run}.json"
            if path.exists():
                out[(run, system)] = json.loads(path.read_text())
    print(f"{'run':10}{'system':18}" + "".join(f"{label:>14}" for _, label in METRICS))
    for (run, system), r in sorted(out.items()):
        print(f"{run:10}{system:18}" + "".join(f"{r.get(k, float('nan')):>14.1f}" for k, _ in METRICS))
    summary = {f"{system}:{run}": {k: out[(run, system)].get(k) for k, _ in METRICS} for run, system in out}
    print("\nCPU seconds per 1,000 output tokens, by server process")
    for (run, system), r in sorted(out.items()):
        cpu = cpu_per_kilotoken(Path(folder), f"{system}-{run}", r.get("total_output_tokens") or 0)
        if cpu:
            summary[f"{system}:{run}"]["cpu_s_per_1k_output_tokens"] = cpu
            print(f"{run:10}{system:18}" + "  ".join(f"{name} {s:.3f}" for name, s in sorted(cpu.items())))
    light = Path(folder) / "light_rate"
    if light.exists():
        summary["light_rate_req_s"] = float(light.read_text())
        print(f"\nlight rate: {summary['light_rate_req_s']} req/s (half of vLLM's measured request throughput)")
    for system in SYSTEMS:
        missing = Path(folder) / f"{system}.missing.json"
        if missing.exists():
            summary[f"{system}:missing_workers"] = json.loads(missing.read_text())
            print(f"{system}: {summary[f'{system}:missing_workers']}")
    (Path(folder) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def cpu_per_kilotoken(folder: Path, run: str, tokens: int) -> dict:
    before, after = folder / f"{run}.cpu-before.json", folder / f"{run}.cpu-after.json"
    if not (before.exists() and after.exists() and tokens):
        return {}
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    return {name: round((b[name] - a.get(name, 0.0)) * 1000 / tokens, 4) for name in b
            if b[name] - a.get(name, 0.0) > 0.005 * tokens / 1000}


if __name__ == "__main__":
    main(sys.argv[1])
