"""LoRA through the mesh (disaggregated: the prefill and the decode worker both apply the adapter) and the OpenAI
front: greedy tokens equal transformers + PEFT with each adapter alone, while requests for four adapters and the
base model run at once; adapters at run time (admin only, all or none, malformed ones refused naming them);
unknown and forbidden adapters; an unload under load loses no request."""

import concurrent.futures
import json
import shutil
import threading
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import yaml

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.policy.tenants import hash_key
from tests.support.lora import ADAPTERS, peft_greedy, save_peft_adapter
from tests.support.mesh import start_mesh, worker_stats
from tests.support.reference import random_prompts

ADMIN, USER, NARROW = "key-admin", "key-user", "key-narrow"
NEW = 10
CONFIGURED = ("qv8", "attn4", "mlp16")  # in the config's lora_dir; all32 is loaded at run time


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-mesh")
    made = {name: save_peft_adapter(tiny_model, root / "made" / name, seed=10 + i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}
    (root / "dir").mkdir()
    for name in CONFIGURED:
        shutil.copytree(made[name], root / "dir" / name)
    return root, made


@pytest.fixture(scope="module")
def mesh(tiny_model, adapters, tmp_path_factory):
    root, _ = adapters
    cfg = {"engine": {"lora_dir": str(root / "dir"), "max_loras": 4},
           "tenants": [{"name": "admin", "api_key_hashes": [hash_key(ADMIN)], "admin": True},
                       {"name": "user", "api_key_hashes": [hash_key(USER)]},
                       {"name": "narrow", "api_key_hashes": [hash_key(NARROW)], "adapters": ["qv8"]}]}
    path = root / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    m = start_mesh(tiny_model, tmp_path_factory, "disaggregated", config_file=str(path))
    yield m
    m.stop()


@pytest.fixture(scope="module")
def cases(tiny_model, adapters):
    """(prompt, adapter) pairs, two per adapter and two for the base model, with PEFT's greedy tokens."""
    _, made = adapters
    prompts = random_prompts(10, seed=21, lo=4, hi=40, vocab=4000)
    names = list(ADAPTERS) + [""]
    out = []
    for k, name in enumerate(names):
        pair = prompts[2 * k:2 * k + 2]
        refs = peft_greedy(tiny_model, made.get(name), pair, NEW)
        out += [(p, name, ref.tokens) for p, ref in zip(pair, refs)]
    return out


def post(mesh, path: str, body: dict, key: str) -> tuple[int, str]:
    req = urllib.request.Request(mesh.http + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def generate(mesh, ids, adapter="", key=USER, model="") -> list:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), adapter=adapter, model=model,
                             sampling=pb.Sampling(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(mesh.gateway) as ch:
        out = list(pb_grpc.GenerationStub(ch).Generate(req, metadata=(("x-api-key", key),), timeout=120))
    return [t for r in out for t in r.token_ids]


def loaded(mesh, adapters):
    _, made = adapters
    status, text = post(mesh, "/v1/load_lora_adapter", {"lora_name": "all32", "lora_path": str(made["all32"])}, ADMIN)
    assert status == 200, text


def test_mixed_adapters_at_once_equal_peft_through_grpc_and_openai(mesh, adapters, cases):
    loaded(mesh, adapters)
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # all at once: batches mix adapters
        got = list(pool.map(lambda c: generate(mesh, c[0], c[1]), cases))
    for (_, name, want), tokens in zip(cases, got):
        assert tokens == want, f"adapter {name or 'base'}: {tokens} != PEFT's {want}"
    client = openai.OpenAI(base_url=mesh.http + "/v1", api_key=USER, max_retries=0, timeout=120)
    for prompt, name, want in cases[::2]:  # model: "<adapter>" selects it, as in vLLM
        done = client.completions.create(model=name or "tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        assert done.model == (name or "tiny")
        assert generate(mesh, prompt, model=name) == want
    models = {m.id: m.model_extra.get("parent") for m in client.models.list()}
    assert models == {"tiny": None, **{name: "tiny" for name in ADAPTERS}}
    stats = [worker_stats(w.address) for w in mesh.workers("prefill") + mesh.workers("decode")]
    assert all(s.lora_loads >= 1 for s in stats), "both roles read adapters"


def test_unknown_and_forbidden_adapters(mesh, adapters):
    for adapter, model, key, code in (("nope", "", USER, grpc.StatusCode.NOT_FOUND),
                                      ("", "nope", USER, grpc.StatusCode.NOT_FOUND),
                                      ("attn4", "", NARROW, grpc.StatusCode.PERMISSION_DENIED)):
        with pytest.raises(grpc.RpcError) as err:
            generate(mesh, [5, 6, 7], adapter, key, model)
        assert err.value.code() == code and "nope" in err.value.details() or code == grpc.StatusCode.PERMISSION_DENIED
    assert generate(mesh, [5, 6, 7], "qv8", NARROW)
    status, text = post(mesh, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}, USER)
    assert status == 404 and "nope" in text


def test_runtime_loads_are_admin_only_and_all_or_none(mesh, adapters, tmp_path):
    _, made = adapters
    status, text = post(mesh, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(made["qv8"])}, USER)
    assert status == 403, text
    bad = shutil.copytree(made["qv8"], tmp_path / "bad")
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 999}))
    status, text = post(mesh, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)}, ADMIN)
    assert status == 400 and "'bad'" in text and "rank" in text, text
    with grpc.insecure_channel(mesh.gateway) as ch:
        listing = pb_grpc.GenerationStub(ch).ListAdapters(pb.ListAdaptersRequest(), metadata=(("x-api-key", USER),),
                                                          timeout=30)
    names = {a.name: a for a in listing.adapters}
    assert "bad" not in names and set(CONFIGURED) <= set(names)
    assert names["qv8"].rank == 8 and list(names["qv8"].targets) == ["q_proj", "v_proj"]
    for w in mesh.workers("prefill") + mesh.workers("decode"):  # nothing half-loaded anywhere
        with grpc.insecure_channel(w.address) as ch:
            assert "bad" not in {a.name for a in pb_grpc.WorkerStub(ch).ListAdapters(pb.ListAdaptersRequest(),
                                                                                       timeout=10).adapters}


def test_unload_under_load_loses_no_request(mesh, adapters, cases):
    """Requests streaming when their adapter is unloaded finish unchanged; new ones are NOT_FOUND."""
    _, made = adapters
    loaded(mesh, adapters)
    mine = [c for c in cases if c[1] == "mlp16"] * 3
    started = threading.Barrier(len(mine) + 1, timeout=120)

    def streamed(prompt):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), adapter="mlp16",
                                 sampling=pb.Sampling(max_tokens=NEW, temperature=0.0, ignore_eos=True))
        tokens = []
        with grpc.insecure_channel(mesh.gateway) as ch:
            for r in pb_grpc.GenerationStub(ch).Generate(req, metadata=(("x-api-key", USER),), timeout=120):
                if not tokens:
                    started.wait()  # every request has its first token before the unload
                tokens += r.token_ids
        return tokens

    with concurrent.futures.ThreadPoolExecutor(len(mine)) as pool:
        running = [pool.submit(streamed, p) for p, _, _ in mine]
        started.wait()
        status, text = post(mesh, "/v1/unload_lora_adapter", {"lora_name": "mlp16"}, ADMIN)
        assert status == 200, text
        results = [f.result() for f in running]
    assert all(r == want for r, (_, _, want) in zip(results, mine))  # accepted requests finished, unchanged
    with pytest.raises(grpc.RpcError) as err:
        generate(mesh, [5, 6], "mlp16")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    status, text = post(mesh, "/v1/load_lora_adapter", {"lora_name": "mlp16", "lora_path": str(made["mlp16"])}, ADMIN)
    assert status == 200, text
    assert generate(mesh, mine[0][0], "mlp16") == mine[0][2]
