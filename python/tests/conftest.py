"""pytest setup: the package is imported from this checkout (python/bie), and libbie from
BIE_LIBRARY or the repository's build trees (see bie/_lib.py)."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


@pytest.fixture(autouse=True)
def _seeded():
    """Fresh but reproducible random data in every test."""
    torch.manual_seed(1234)
    yield


def pytest_report_header(config):
    import bie
    return f"libbie: {bie.library_path()} (version {bie.version()}, CPU kernels " \
           f"{bie.cpu_kernel_set()}, CUDA backend {'yes' if bie.cuda_built() else 'no'})"
