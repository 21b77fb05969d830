"""A discrete-event simulator of a meshserve cluster, on the services' own policy objects (docs/SIMULATION.md).

trace.py: requests (synthetic or replayed JSONL); cost.py: the engine's step cost, fitted from a real
worker's steps; worker.py: a worker as its real scheduler, KV manager and block pool, with simulated step
times; cluster.py: gateways, routers, workers, KV links and the autoscaler as events; report.py: results and
plots; studies.py: the at-scale studies; run.py: one simulation (simulate(): whole, or its independent cells in
parallel processes).
"""
