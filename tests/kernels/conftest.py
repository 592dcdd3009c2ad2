"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else on the CPU through Triton's
interpreter (switched on in tests/conftest.py, before the kernels are defined)."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernel tests need triton (pip install triton==3.6.0)")

def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Triton 3.6's interpreter converts 1-element arrays with int(), which numpy deprecated (and
    2.4 refuses: the test extra pins numpy < 2.4)."""
    for item in items:
        if "tests/kernels/" in str(item.fspath):
            item.add_marker(pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
