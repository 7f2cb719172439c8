import os
import shutil
import sys
import tempfile
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# a pass failure raises (and every graph the pass makes is linted) instead of warning and running unfused
os.environ.setdefault("FUSER_STRICT_PASS", "1")
warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.jit.script's since 2.11
# a fresh kernel cache per session (unless one is given): tests count compiles, and the CPU backend's kernels are
# cached on disk like CUDA's; subprocesses of the tests inherit it
if "FUSER_CACHE_DIR" not in os.environ:
    os.environ["FUSER_CACHE_DIR"] = _SESSION_CACHE = tempfile.mkdtemp(prefix="fuser-test-cache-")
else:
    _SESSION_CACHE = None

import fuser  # noqa: E402
from fuser import settings  # noqa: E402


SEED = int(os.environ.get("FUSER_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    # the native hot path serves every test's repeated calls (built here once per session; FUSER_NATIVE=0: off)
    from fuser import native
    native.ensure(block=True)


def pytest_report_header(config):
    from fuser import native
    return (f"fuser test seed: FUSER_TEST_SEED={SEED} (fresh random inputs each run; set it to replay one); "
            f"native hot path: {native.status()}")


@pytest.fixture(autouse=True)
def _seed(request):
    import zlib
    torch.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))


def pytest_unconfigure(config):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    emulate = sys.modules.get("fuser.cuda.emulate")  # imported by tests/test_cuda_emulated.py when it runs
    line = emulate.summary() if emulate is not None else None
    if line:
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def needs_cpu_fusion():
    """For a module whose every test needs the CPU backend (``pytestmark = pytest.mark.usefixtures(...)``): a
    machine without a C++ compiler fails its tests rather than skipping them."""
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")


@pytest.fixture
def _backwards(monkeypatch):
    """The backward groups that run as kernels during the test (helpers.record_backward_runs)."""
    from helpers import record_backward_runs
    return record_backward_runs(monkeypatch)


@pytest.fixture(autouse=True)
def _clean_state():
    """Each test starts with fusion on where possible and the pass uninstalled."""
    yield
    settings.override_can_fuse_on_cpu(None)
    settings.override_can_fuse_on_gpu(None)
    fuser.uninstall()
