#!/usr/bin/env bash
# Each line: one routing or admission rule changed on one side alone (the file restored after), then the parity
# test. Every change must make tests/unit/test_parity.py fail. Output of 2026-12-04: parity-mutations.txt.
set -u
cd "$(dirname "$0")/../../.."
try() { # file old new label
  cp "$1" /tmp/mut.bak
  python3 - "$1" "$2" "$3" <<'PY'
import sys
p,o,n=sys.argv[1:4]; s=open(p).read(); assert o in s, o; open(p,'w').write(s.replace(o,n,1))
PY
  r=$(timeout 300 .venv/bin/python -m pytest -q tests/unit/test_parity.py 2>&1 | tail -1)
  cp /tmp/mut.bak "$1"
  echo "$4: $r"
}
try sim/cluster.py 'Need(role, after.block_size if after else 0, adapter)' 'Need(role, 0, adapter)' "sim: decode hop ignores the block size"
try sim/cluster.py 'near=after.topology if after else ""' 'near=""' "sim: decode hop ignores topology"
try sim/cluster.py 'route = hashes[:(len(tokens) - 1) // views[0].block_size]' 'route = hashes' "sim: routes by every full block"
try services/router/server.py 'pick = picker.pick(workers, cost, request.adapter, prompt, homes, near)' 'pick = picker.pick(workers, cost, "", prompt, homes, near)' "router: adapter not passed to the scorers"
try services/router/server.py 'workers = self.registry.live(Need(role, block_size, request.adapter, frozenset(request.avoid)))' 'workers = self.registry.live(Need(role, block_size, "", frozenset(request.avoid)))' "router: adapter filter off"
try sim/cluster.py 'self.kv = (sum(v.capacity_tokens for v in views), sum(v.outstanding_tokens for v in views))' 'self.kv = (0, 0)' "sim gateway: no KV room check"
try sim/cluster.py 'core.set_view(MeshView(max(self.slots(), 1), *self.kv))' 'core.set_view(MeshView(max(self.slots(), 1) + 1, *self.kv))' "sim gateway: one slot more"
try services/gateway/admission.py '        super().done(p, output_tokens, first_token_s, last_token_s)' '        super().done(p, output_tokens, None, None)' "gateway: completions teach nothing"
try sim/cluster.py "t = self.tenants[name] = Tenant(name, weight=float(self.c.spec.tenant_weights.get(name, 1.0)))" "t = self.tenants[name] = Tenant(name)" "sim gateway: tenant weights dropped"
