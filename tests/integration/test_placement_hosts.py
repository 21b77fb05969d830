"""Placement in the real mesh across network hosts: two network namespaces joined to this one by veth pairs on a
bridge (made here), each a host of the mesh (MeshSpec.hosts) with its own address and cores. The control plane
(Redis, kvstore, router, gateway) listens on the bridge. A TP=2 prefill group (2 cores) lands whole on the host
where it fits best, its decode peer beside it, and the next decode worker on the best fit of the empty hosts;
every process of a worker (servicer, engine core, rank) runs in its host's namespace, registers under its host's
address and place, and streams across the hosts equal one engine's greedy tokens."""

import asyncio
import os
import secrets
import subprocess

import pytest

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import Mesh, MeshSpec, client_channel
from services.policy.placement import Host
from tests.support.mesh import ENGINE
from tests.support.procs import children
from tests.support.reference import greedy, make_engine, random_prompts, run_all
from tests.support.streams import greedy_streams


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def network():
    """A bridge with 10.213.N.1 here and two namespaces at .2 and .3 (names unique to this run)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag, subnet = secrets.token_hex(3), 10 + secrets.randbelow(240)
    bridge, names = f"msbr{tag}", [f"ms{tag}a", f"ms{tag}b"]
    made = []
    try:
        ip("link", "add", bridge, "type", "bridge")
        made.append(("link", "del", bridge))
        ip("addr", "add", f"10.213.{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i, ns in enumerate(names):
            ip("netns", "add", ns)
            made.append(("netns", "del", ns))
            outside, inside = f"{ns}o", f"{ns}i"
            ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            ip("link", "set", inside, "netns", ns)
            ip("link", "set", outside, "master", bridge)
            ip("link", "set", outside, "up")
            ip("-n", ns, "addr", "add", f"10.213.{subnet}.{i + 2}/24", "dev", inside)
            ip("-n", ns, "link", "set", inside, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield f"10.213.{subnet}.1", [(ns, f"10.213.{subnet}.{i + 2}") for i, ns in enumerate(names)]
    finally:
        for cmd in reversed(made):
            subprocess.run(["ip", *cmd], capture_output=True)


@pytest.fixture(scope="module")
def mesh(tiny_model, network, tmp_path_factory):
    control, namespaces = network
    hosts = [Host("host-a", 3, address=namespaces[0][1], netns=namespaces[0][0], rack="r1"),
             Host("host-b", 4, address=namespaces[1][1], netns=namespaces[1][0], rack="r1"),
             Host("local", 1, rack="r1")]  # this machine's own network, beside the kvstore
    spec = MeshSpec(str(tiny_model), mode="disaggregated", prefill=1, decode=2, engine_args=ENGINE, hosts=hosts,
                    control_address=control, worker_args={"prefill-0": ["--tensor-parallel-size", "2"]},
                    http_port=None)
    m = Mesh(spec, log_dir=str(tmp_path_factory.mktemp("hosts"))).start()
    yield m
    m.stop()


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_a_group_lands_whole_with_its_decode_peer_beside_it(mesh, network, tiny_model):
    """prefill-0 (2 cores) fits host-a best (1 left), decode-0 takes that core (in use before empty), decode-1 the
    best fit of the empty hosts: this machine's one core, where it keeps the kvstore's host identity."""
    from services.common.host import host_id

    _, namespaces = network
    ns_of = {os.stat(f"/run/netns/{ns}").st_ino: host for (ns, _), host in zip(namespaces, ("host-a", "host-b"))}
    ns_of[netns_inode(os.getpid())] = "local"
    placed = {p.name: p.group.host for p in mesh.workers("prefill") + mesh.workers("decode")}
    assert placed == {"prefill-0": "host-a", "decode-0": "host-a", "decode-1": "local"}
    assert mesh.proc("prefill-0").group.size == 2
    for p in mesh.workers("prefill") + mesh.workers("decode"):  # the servicer, its core and (TP) its rank
        pids = [p.popen.pid] + children(p.popen.pid)
        pids += [r for c in pids[1:] for r in children(c)]
        assert {ns_of.get(netns_inode(pid)) for pid in pids} == {placed[p.name]}, p.name
        if p.name == "prefill-0":
            assert len(pids) >= 3  # servicer, engine core, rank 1: the whole group on host-a
    with client_channel(mesh.router) as ch:
        workers = {w.worker_id: w for w in pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(),
                                                                                timeout=5).workers}
    addresses = {"host-a": namespaces[0][1], "host-b": namespaces[1][1], "local": "127.0.0.1"}
    for name, host in placed.items():
        assert workers[name].address.startswith(addresses[host] + ":")
        assert (workers[name].host, workers[name].topology) == (host if host != "local" else host_id(), f"r1/{host}/")
    assert workers["prefill-0"].tensor_parallel_size == 2 and workers["prefill-0"].cores == 2
    prompts = random_prompts(8, seed=43, lo=4, hi=60, vocab=4000)
    got = asyncio.run(greedy_streams(mesh.gateway, prompts, 16))
    assert [status for _, status in got] == [None] * len(prompts)
    assert [tokens for tokens, _ in got] == run_all(make_engine(tiny_model), prompts, greedy(16))


def test_a_replica_with_no_room_is_refused_and_the_rest_keep_serving(mesh):
    from services.mesh.launcher import NoRoom

    with pytest.raises(NoRoom, match="no host has 1 free cores"):
        mesh.scale("decode", 7, say=lambda line: None)  # host-b takes four more; the fifth fits nowhere
    assert len(mesh.workers("decode")) == 6
    assert {p.group.host for p in mesh.workers("decode")[2:]} == {"host-b"}
    mesh.scale("decode", 2, say=lambda line: None)  # drain the extra ones again
