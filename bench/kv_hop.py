"""The KV hop across network hosts: put and get of a worker's KV blocks through a kvstore on another host (a
container on a bridge network), over the kvstore's cross-host path (bytes in gRPC messages), beside a raw TCP copy
of the same bytes between the same two hosts. Issue 14 measured only loopback and shared memory.

    python -m bench.kv_hop sink --port 7000                      # on the kvstore's host (a socket sink)
    python -m bench.kv_hop probe --kvstore kvstore:50053 --sink HOST:7000 [--mb 256] [--repeat 3]

docs/OPERATIONS.md runs it between containers of deploy/docker-compose.yml.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket

from bench.mesh_mixed import kv_rates, socket_sink


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_hop", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sink", help="read TCP connections to their end (the raw copy's other side)")
    s.add_argument("--port", type=int, default=7000)
    s.add_argument("--connections", type=int, default=100)
    p = sub.add_parser("probe", help="put and get KV blocks through the kvstore, then the raw copy")
    p.add_argument("--kvstore", required=True)
    p.add_argument("--sink", required=True, help="HOST:PORT of a running `sink`")
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if args.command == "sink":
        server = socket.create_server(("0.0.0.0", args.port))
        print(f"sink on :{args.port}", flush=True)
        socket_sink(server, args.connections)
        return
    host, port = args.sink.rsplit(":", 1)
    for run in range(args.repeat):
        rates = kv_rates(args.kvstore, total=args.mb << 20, shm=False, sink=(host, int(port)))
        print(json.dumps({"run": run, "from": platform.node(), "kvstore": args.kvstore, **rates}), flush=True)


if __name__ == "__main__":
    main()
