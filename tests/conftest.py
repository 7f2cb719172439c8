import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.jit.script's since 2.11

import fuser  # noqa: E402
from fuser import settings  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_state():
    """Each test starts with fusion on where possible and the pass uninstalled."""
    yield
    settings._override_cpu = None
    settings._override_gpu = None
    fuser.uninstall()
