"""The router's decision: Filter -> Scorer -> Picker over worker views (docs/ROUTING.md). pick.py is the one core
that the router's servicer and the simulator both run."""
