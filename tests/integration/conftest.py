
import pytest

from tests.support.mesh import start_mesh


@pytest.fixture(scope="module")
def disaggregated(tiny_model, tmp_path_factory):
    mesh = start_mesh(tiny_model, tmp_path_factory, "disaggregated")
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def unified(tiny_model, tmp_path_factory):
    mesh = start_mesh(tiny_model, tmp_path_factory, "unified")
    yield mesh
    mesh.stop()

