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
    from services.engine.model_init import write_model

    return write_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")
