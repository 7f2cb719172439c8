"""``python -m fuser.bench --models``: the zoo's systems are built side by side and timed in interleaved rounds;
each cell has its first call checked against eager's output, a median over every round's forwards, and fuser's
groups. Run on the CPU at the tiny sizes (transformers is a test extra)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from fuser.bench import models  # noqa: E402

pytestmark = pytest.mark.usefixtures("needs_cpu_fusion")  # (tests/conftest.py)


def test_the_zoo_timing_interleaves_the_systems(monkeypatch):
    calls = []
    real = models.elapsed_ms

    def timed(fn, device):
        calls.append(len(calls))
        return real(fn, device)

    monkeypatch.setattr(models, "elapsed_ms", timed)
    seen = []
    make = models.make

    def recording(name, model, inputs):
        fn, settings = make(name, model, inputs)

        def call(*a):
            seen.append(name)
            return fn(*a)
        if hasattr(fn, "graph"):
            call.graph = fn.graph  # (fuser's groups are counted in its graph)
        return call, settings

    monkeypatch.setattr(models, "make", recording)
    timing = models.Timing(warmup=1, warmup_s=0.0, runs=6, rounds=3)
    cells = models.run_model("gpt2", ["eager", "fuser"], True, torch.device("cpu"), torch.float32, timing)
    assert [c["system"] for c in cells] == ["eager", "fuser"]
    for c in cells:
        assert "error" not in c, c
        assert len(c["samples_ms"]) == 6 and c["ms"] > 0
        assert c["rel_error"] < 1e-5
    assert cells[1]["groups"] >= 5  # the residual adds with their layer_norms and the GELU chains
    assert len(calls) == 12
    # the timed forwards: 2 of eager, 2 of fuser, three times over (after each system's first call and warm-up)
    timed_calls = seen[-12:]
    assert timed_calls == (["eager"] * 2 + ["fuser"] * 2) * 3


def test_a_failing_system_records_its_error(monkeypatch):
    make = models.make

    def broken(name, model, inputs):
        if name == "fuser":
            raise RuntimeError("no kernel today")
        return make(name, model, inputs)

    monkeypatch.setattr(models, "make", broken)
    timing = models.Timing(warmup=1, warmup_s=0.0, runs=2, rounds=1)
    cells = models.run_model("gpt2", ["eager", "fuser"], True, torch.device("cpu"), torch.float32, timing)
    assert cells[1]["error"] == "RuntimeError: no kernel today" and "ms" in cells[0]
