"""Plots of load sweeps (bench/sweep.py): latency percentiles against offered load, one line per policy."""

from __future__ import annotations

from pathlib import Path

from bench.common import log

PLOTTED = (("ttft_ms_p99", "TTFT p99 (ms)"), ("e2e_ms_p99", "e2e p99 (ms)"))


def plot_path(args) -> str:
    """--plot, else --out's name with .png, else "" (no plot)."""
    if args.plot:
        return args.plot
    return str(Path(args.out).with_suffix(".png")) if args.out else ""


def plot_sweep(result: dict, path: str, metrics=PLOTTED) -> bool:
    """One panel per metric, offered load (fraction of the sustainable rate) on x, log-scale milliseconds on y,
    a line per system swept over loads (a marker for one run at one load). False (and a message) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no plot: matplotlib is not installed (bash scripts/setup.sh bench)")
        return False
    systems = {name: s["loads"] for name, s in result["systems"].items() if s.get("loads")}
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    for ax, (metric, label) in zip(axes[0], metrics):
        for name, loads in systems.items():
            points = [(p["load"], p[metric]) for p in loads if p.get(metric) is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o" if len(loads) > 1 else "X",
                    linestyle="-" if len(loads) > 1 else "none", label=name)
        ax.set_xlabel("offered load (fraction of the sustainable rate)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    machine = result.get("machine", {})
    fig.suptitle(f"{result['workload']}: {machine.get('cpu_model', '')}, {machine.get('cpus', '?')} CPUs, "
                 f"sustainable {result['config'].get('sustainable_req_per_s', '?')} req/s", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")
    return True
