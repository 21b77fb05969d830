"""Generated from protos/ by scripts/gen_protos.py. Never edit by hand."""
