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
# cached on disk like CUDA's; subprocesses of the tests inherit it. Under pytest-xdist (the README's command runs
# the files in two worker processes) each worker gets a cache of its own, seeded with the controller's (the native
# hot path it built once), so a worker's compile counts are what a serial run's are.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if "FUSER_CACHE_DIR" not in os.environ:
    os.environ["FUSER_CACHE_DIR"] = os.environ["FUSER_TEST_SESSION_CACHE"] = _SESSION_CACHE = \
        tempfile.mkdtemp(prefix="fuser-test-cache-")
elif _WORKER and os.environ["FUSER_CACHE_DIR"] == os.environ.get("FUSER_TEST_SESSION_CACHE"):
    _SESSION_CACHE = tempfile.mkdtemp(prefix=f"fuser-test-cache-{_WORKER}-")
    for _entry in os.scandir(os.environ["FUSER_CACHE_DIR"]):
        if _entry.is_file() and not _entry.name.startswith("."):
            shutil.copy2(_entry.path, _SESSION_CACHE)
    os.environ["FUSER_CACHE_DIR"] = _SESSION_CACHE
else:
    _SESSION_CACHE = None

import fuser  # noqa: E402
from fuser import settings  # noqa: E402


SEED = int(os.environ.get("FUSER_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))
os.environ["FUSER_TEST_SEED"] = str(SEED)  # xdist's workers inherit the controller's draw


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


def _emulation_summary():
    emulate = sys.modules.get("fuser.cuda.emulate")  # imported by the tests that emulate CUDA kernels
    return emulate.summary() if emulate is not None else None


_WORKER_SUMMARIES = []


def pytest_sessionfinish(session):
    if _WORKER and hasattr(session.config, "workeroutput"):  # an xdist worker hands its line to the controller
        session.config.workeroutput["emulation"] = _emulation_summary()


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's; the tests also run without it
def pytest_testnodedown(node, error):  # the controller, as each xdist worker ends
    line = getattr(node, "workeroutput", {}).get("emulation")
    if line:
        _WORKER_SUMMARIES.append(f"{node.gateway.id}: {line}")


def pytest_terminal_summary(terminalreporter):
    for line in [_emulation_summary(), *_WORKER_SUMMARIES]:
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
