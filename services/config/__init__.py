"""The mesh config: one validated model per section of the mesh file, and one override mechanism.

The layer under every service (it imports none; tests and the import contracts hold it):
sections.py (the schema), loader.py (file, environment and overrides, and the error messages), flags.py (the
flags generated from the sections), engine.py (the engine's own config and its section).

A mesh file (YAML or TOML) has the sections mesh, engine, routing, admission, kv and tenants; each is
a pydantic model that forbids unknown keys, so a typo is an error, never a silent default. Every
service reads the one file (`--config FILE`, env MESHSERVE_CONFIG) and takes only its section:
workers the engine section, the router the routing section, the gateway tenants and admission.

Values are layered, later wins: the section's defaults, the file, environment variables
`MESHSERVE_<SECTION>__<KEY>` (e.g. MESHSERVE_ENGINE__MAX_NUM_SEQS=64), then the service's flags,
which are generated from the same models (`--max-num-seqs 64`). Every error names the file (or
the environment variable, or the flag), the section and the key:
`mesh.yaml: engine.max_num_seqs: must be greater than 0 (got -1)`.
"""
