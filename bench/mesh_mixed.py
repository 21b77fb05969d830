"""Workload mesh-mixed: the in-process engine vs the mesh, disaggregated and unified.

128 requests with the engine-mixed length distribution (prompts 32-512, outputs 16-256, greedy,
EOS ignored), bench preset, one torch thread per engine, Poisson arrivals at 50% of the unified
worker's saturation throughput (measured first, in the same run, by sending every request at
once through a unified mesh). Systems: in-process (the engine alone, requests added at their
arrival times), mesh-disaggregated (1 prefill + 1 decode worker, KV through the kvstore's shared memory),
mesh-disaggregated-grpc (the same with KV bytes in gRPC messages), mesh-unified (1 unified worker).
Also: added_ttft_ms_low_load (mesh-disaggregated minus in-process TTFT p50, one request at a
time on the same 32 prompts with 16-token outputs, unseen by either so that neither hits a prefix cache), and the KV
transfer rate per hop (256 MB of the model's blocks put into and got from the kvstore over each transport, as the
workers do) beside a raw loopback socket copy.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import threading
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import grpc

from bench.common import default_model, log, machine, print_table, random_requests, write_result
from bench.latency import Timing, poisson_arrivals, summarize
from bench.online import drive
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec

ENGINE_ARGS = ["--kv-cache-gb", "1.0", "--max-num-batched-tokens", "512"]


def add_flags(p) -> None:
    g = p.add_argument_group("mesh-mixed")
    g.add_argument("--load", type=float, default=0.5, help="arrival rate as a fraction of saturation")


def run(args) -> int:
    model_dir = Path(args.model) if args.model else default_model("bench")
    n = 32 if args.quick else 128
    reqs = random_requests(n, (32, 512), (16, 256), vocab=32000, seed=args.seed)
    systems, extra = {}, {}
    with Mesh(MeshSpec(str(model_dir), mode="unified", engine_args=ENGINE_ARGS)) as mesh:
        log("saturation: every request at once through one unified worker")
        _warm(mesh.gateway)
        sat = asyncio.run(_online(mesh.gateway, reqs, [0.0] * n))
        rate = args.load * n / sat["wall_s"]
        log(f"saturation {n / sat['wall_s']:.2f} req/s; offered load {rate:.2f} req/s")
        arrivals = poisson_arrivals(n, rate, args.seed)
    # A fresh mesh for every measured system: the saturation burst sent the same prompts, and a mesh that has
    # them in its prefix cache computes almost nothing of them again (this run's unified TTFT used to include that).
    with Mesh(MeshSpec(str(model_dir), mode="unified", engine_args=ENGINE_ARGS)) as mesh:
        _warm(mesh.gateway)
        log("mesh-unified")
        systems["mesh-unified"] = asyncio.run(_online(mesh.gateway, reqs, arrivals))
    with Mesh(MeshSpec(str(model_dir), mode="disaggregated", decode=1, engine_args=ENGINE_ARGS,
                       kv_transport="grpc")) as mesh:
        _warm(mesh.gateway)
        log("mesh-disaggregated-grpc (KV bytes in gRPC messages)")
        systems["mesh-disaggregated-grpc"] = asyncio.run(_online(mesh.gateway, reqs, arrivals))
    with Mesh(MeshSpec(str(model_dir), mode="disaggregated", decode=1, engine_args=ENGINE_ARGS)) as mesh:
        _warm(mesh.gateway)
        log("mesh-disaggregated (KV through the kvstore's shared memory)")
        systems["mesh-disaggregated"] = asyncio.run(_online(mesh.gateway, reqs, arrivals))
        # Fresh prompts (same length distribution): prompts the mesh already served would hit its prefix cache.
        low = random_requests(32, (32, 512), (16, 16), vocab=32000, seed=args.seed + 500)
        log("low load, one request at a time: mesh-disaggregated")
        mesh_solo = asyncio.run(_online(mesh.gateway, low, None))
        extra.update(kv_rates(mesh.kvstore))
    log("in-process (in a fresh process, so nothing of the meshes' gRPC runtime competes with it)")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        solo = pool.submit(in_process, model_dir, low, None).result()
        systems["in-process"] = pool.submit(in_process, model_dir, reqs, arrivals).result()
    extra["added_ttft_ms_low_load"] = round(mesh_solo["ttft_ms_p50"] - solo["ttft_ms_p50"], 2)
    uni, dis = systems["mesh-unified"], systems["mesh-disaggregated"]
    extra["disaggregated/unified:ttft_ms_p50"] = round(dis["ttft_ms_p50"] / uni["ttft_ms_p50"], 3)
    extra["offered_rate_req_per_s"] = round(rate, 3)
    result = {"workload": "mesh-mixed", "command": args.command_line, "machine": machine(),
              "config": {"requests": n, "load": args.load, "engine_args": ENGINE_ARGS, "model": str(model_dir),
                         "threads_per_engine": 1},
              "systems": systems, **extra}
    write_result(result, args.out)
    print_table(result)
    for k, v in extra.items():
        print(f"{k}: {v}")
    return 0


def _warm(gateway: str) -> None:
    asyncio.run(_online(gateway, random_requests(4, (32, 64), (4, 4), 32000, seed=99), None))


async def _online(gateway: str, reqs: list, arrivals: list | None) -> dict:
    """Stream every request through the gateway at its arrival time (None: one at a time)."""
    t0 = time.perf_counter()
    timings = await drive(gateway, reqs, arrivals, timeout_s=600)
    return summarize(timings, time.perf_counter() - t0)


def in_process(model_dir: Path, reqs: list, arrivals: list | None) -> dict:
    """The engine alone, one thread: requests join at their arrival times (None: one at a time)."""
    import argparse

    import torch

    from services.common.sampling import SamplingParams
    from services.config.flags import add_section_flags, flag_overrides
    from services.config.loader import load_mesh_config
    from services.engine.engine import LLMEngine

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    add_section_flags(ap, "engine")
    section = load_mesh_config(None, flag_overrides(ap.parse_args(ENGINE_ARGS), "engine"), env={}).engine
    engine = LLMEngine(section.to_engine_config(str(model_dir)))
    for i, r in enumerate(random_requests(4, (32, 64), (4, 4), 32000, seed=99)):
        engine.add_request(f"warm{i}", r["prompt_token_ids"], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    timings = {}
    pending = list(zip(reqs, arrivals if arrivals is not None else [None] * len(reqs)))
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and (pending[0][1] is None and not engine.has_unfinished() or
                           pending[0][1] is not None and t0 + pending[0][1] <= now):
            r, _ = pending.pop(0)
            timings[r["id"]] = Timing(arrival_s=time.perf_counter())
            engine.add_request(r["id"], r["prompt_token_ids"], SamplingParams(max_tokens=r["max_tokens"],
                                                                              temperature=0.0, ignore_eos=True))
        if not engine.has_unfinished():
            time.sleep(0.001)
            continue
        for out in engine.step():
            timings[out.req_id].on_tokens(time.perf_counter(), out.new_token_ids)
    return summarize(list(timings.values()), time.perf_counter() - t0)


def kv_rates(kvstore: str, total: int = 256 * 1024 * 1024, per_message: int = 16, shm: bool = True,
             sink: tuple[str, int] | None = None) -> dict:
    """GB/s of one put and one get of `total` bytes of the mesh's KV blocks, `per_message` blocks per message (as
    a prefill step sends a 256-token chunk of the bench model), as workers do it over each transport: gRPC (bytes
    in messages) and shared memory (bytes written into and read out of the kvstore's arena, with their checksum
    (XXH3-64);
    only metadata in messages). Beside a raw loopback socket copy of the same bytes.

    Across hosts (bench/kv_hop.py, between containers): shm=False, and the raw copy goes to `sink` (a socket_sink
    on the kvstore's side) instead of loopback."""
    from services.common.arena import MappedArena, checksum
    from services.common.host import host_id

    async def hops(shm: bool) -> tuple[float, float]:
        async with grpc.aio.insecure_channel(kvstore, options=[("grpc.max_receive_message_length", 1 << 26)]) as ch:
            stub = pb_grpc.KVStoreStub(ch)
            size = (await stub.Stats(pb.StatsRequest())).block_bytes
            count = total // size
            a = await stub.Attach(pb.AttachRequest(host=host_id(), block_bytes=size, transport="shm" if shm
                                                   else "grpc"))
            arena = MappedArena(a.segment, a.generation, a.slot_bytes, a.slots) if shm else None
            if arena is not None:
                arena.populated.join()  # as in a worker, whose mapping is populated ~0.3 s after it attaches
            blocks = [bytes([i % 251]) * size for i in range(per_message)]
            crcs = [checksum(b) for b in blocks]
            sink = [bytearray(size) for _ in range(per_message)]  # the decode side's paged cache, as it were
            tid = f"bench-{uuid.uuid4().hex}"
            t = time.perf_counter()
            r = await stub.Reserve(pb.ReserveRequest(transfer_id=tid, num_blocks=count, block_bytes=size))

            async def chunks():
                for first in range(0, count, per_message):
                    n = min(per_message, count - first)
                    if shm:
                        sums = []
                        for j in range(n):
                            view = arena.slot(r.slots[first + j])
                            view[:] = blocks[j]
                            sums.append(checksum(view))
                        yield pb.KVChunk(transfer_id=tid, first_block=first, checksums=sums)
                    else:
                        yield pb.KVChunk(transfer_id=tid, first_block=first, checksums=crcs[:n],
                                         data=b"".join(blocks[:n]))
                yield pb.KVChunk(transfer_id=tid, index=-1, meta=pb.KVMeta(), last=True)

            await stub.Put(chunks())
            put_s = time.perf_counter() - t
            t = time.perf_counter()
            got = 0
            async for c in stub.Get(pb.GetRequest(transfer_id=tid, shm=shm, generation=a.generation if shm else "")):
                if c.last:
                    break
                for j, crc in enumerate(c.checksums):
                    view = arena.slot(c.slots[j]) if shm else memoryview(c.data)[j * size:(j + 1) * size]
                    if checksum(view) != crc:
                        raise AssertionError("a block failed its checksum")
                    sink[j % per_message][:] = view
                    got += size
            get_s = time.perf_counter() - t
            await stub.Release(pb.ReleaseRequest(transfer_id=tid))
            if arena is not None:
                arena.close()
            assert got == count * size
            return put_s, get_s, count * size, size

    put_s, get_s, nbytes, size = asyncio.run(hops(shm=False))
    gb = nbytes / 1e9
    rates = {"kv_put_gbytes_per_s": round(gb / put_s, 3), "kv_get_gbytes_per_s": round(gb / get_s, 3)}
    if shm:
        shm_put_s, shm_get_s, _, _ = asyncio.run(hops(shm=True))
        rates.update(kv_put_shm_gbytes_per_s=round(gb / shm_put_s, 3), kv_get_shm_gbytes_per_s=round(gb / shm_get_s, 3))
    if sink is None:
        rates["loopback_copy_gbytes_per_s"] = round(gb / _loopback_copy(nbytes, per_message * size), 3)
    else:
        rates["socket_copy_gbytes_per_s"] = round(gb / _socket_copy(sink, nbytes, per_message * size), 3)
    return rates


def socket_sink(server: socket.socket, connections: int = 1) -> None:
    """Accept `connections` connections on a listening socket, one after another, and read each to its end."""
    for _ in range(connections):
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 20):
                pass


def _socket_copy(to: tuple[str, int], total: int, block: int) -> float:
    """Seconds to send `total` bytes in `block`-sized writes to a socket_sink at `to`, until it has read them."""
    data = bytes(block)
    t = time.perf_counter()
    with socket.create_connection(to) as c:
        for _ in range(total // block):
            c.sendall(data)
        c.shutdown(socket.SHUT_WR)
        c.recv(1)  # the sink closes once it has read everything
    return time.perf_counter() - t


def _loopback_copy(total: int, block: int) -> float:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    th = threading.Thread(target=socket_sink, args=(server,))
    th.start()
    elapsed = _socket_copy(server.getsockname(), total, block)
    th.join()
    server.close()
    return elapsed
