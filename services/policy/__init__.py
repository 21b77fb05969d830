"""The I/O-free decision cores: plain objects fed plain data, with an injected clock, no gRPC, Redis or torch.

The services wrap them (asyncio servicers translate protobuf to these objects and back), the simulator drives the
very same objects (sim/), and unit tests feed them tables. `lint-imports` holds this package to that (pyproject).

- admission_core.py: the gateway's admission core (tenants' limits, the queue, room on the mesh, the fair bypass);
  admission_queue.py: the queue itself and its service-time model; arbitration.py: who gets the next slot (FCFS, fair
  shares, deadline slack), also the engine's slot arbitration; tenants.py: tenants, keys and their limits.
- credit_ledger.py: a worker's batch slots as credits granted to gateways.
- routing/: the router's pick (filters -> context -> policy -> commit) and its scorers and adapter placement.
- scaling.py: the autoscaler's policies (token signals -> desired replicas); placement.py: tensor-parallel
  groups onto devices under topology constraints (not yet called by the running mesh: issue 40).
"""
