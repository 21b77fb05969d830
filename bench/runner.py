"""`meshserve bench WORKLOAD`: the registry of named workloads and their shared flags."""

from __future__ import annotations

import argparse
import shlex
import sys

from bench import (
    burst_autoscale,
    cluster_claims,
    engine_mixed,
    lora_zipf,
    mesh_mixed,
    mock_cluster,
    prefix_shared,
    priority_overload,
    router_latency,
    sampler,
    scale_from_zero,
    sim_validate,
    skewed_costs,
    soak,
    structured,
    sweep,
    tenants_overload,
    tensor_parallel,
)

WORKLOADS = {"engine-mixed": engine_mixed, "mesh-mixed": mesh_mixed, "prefix-shared": prefix_shared,
             "skewed-costs": skewed_costs, "router-latency": router_latency, "tenants-overload": tenants_overload,
             "sampler": sampler, "soak": soak, "lora-zipf": lora_zipf,
             "burst-autoscale": burst_autoscale, "sim-validate": sim_validate, "scale-from-zero": scale_from_zero,
             "priority-overload": priority_overload, "structured": structured,
             "tensor-parallel": tensor_parallel, "mock-cluster": mock_cluster,
             "cluster-claims": cluster_claims}


def add_bench_parser(sub, func) -> None:
    p = sub.add_parser("bench", help="run a named benchmark workload")
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--quick", action="store_true", help="a smaller run for smoke tests")
    p.add_argument("--model", help="model folder (default: the bench preset, generated on first use)")
    p.add_argument("--threads", type=int, help="torch threads (default: every core)")
    p.add_argument("--seed", type=int, default=0)
    for module in WORKLOADS.values():
        module.add_flags(p)
    sweep.add_flags(p)
    p.set_defaults(func=func)


def run_workload(args: argparse.Namespace) -> int:
    args.command_line = "meshserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        return WORKLOADS[args.workload].run(args)
    except ValueError as e:  # a flag or file the workload cannot use: say which, no traceback
        print(f"meshserve bench {args.workload}: {e}", file=sys.stderr)
        return 2
