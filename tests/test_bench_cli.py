"""The benchmark's command line: --sizes picks the rows' sizes."""
import json

import pytest

from fuser.bench import cli


def test_sizes_parses_a_comma_list_and_refuses_unknown_sizes():
    assert cli.parse_args(["--device", "cpu", "--sizes", "large"]).sizes == ["large"]
    assert cli.parse_args(["--device", "cpu"]).sizes == ["large", "small"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", "--sizes", "huge"])


def test_only_the_sizes_asked_for_are_run(tmp_path):
    out = tmp_path / "rows.json"
    assert cli.main(["--device", "cpu", "--quick", "--only", "=mul_add", "--sizes", "small", "--systems", "eager",
                     "--json", str(out), "--png", str(tmp_path / "chart.png")]) == 0
    got = json.loads(out.read_text())
    rows = got["rows"]
    assert rows and {r["size"] for r in rows} == {"small"} and {r["workload"] for r in rows} == {"mul_add"}
    # the host floor: an eager op, and its training step (two ops and the autograd engine: longer)
    floor = got["meta"]["host_floor_us"]
    assert 0 < floor["eager_op"] < floor["eager_train_step"], floor


def test_small_rows_break_the_fused_calls_host_time_down(tmp_path, capsys):
    """A small row's fuser cell carries the native hot path's phases (µs per call, summing to less than the
    call's host time) and the calls it served per call; the report prints them."""
    from fuser import native
    if not native.loaded():
        pytest.skip(f"native hot path: {native.status()}")
    out = tmp_path / "rows.json"
    assert cli.main(["--device", "cpu", "--quick", "--only", "=mul_add", "--sizes", "small", "--systems",
                     "eager,fuser", "--json", str(out), "--png", str(tmp_path / "chart.png")]) == 0
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        cell = r["cells"]["fuser"]
        phases = cell["host_phases_us"]
        assert set(phases) == set(native.PHASES) and cell["native_calls_per_call"] == 1
        assert 0 < sum(phases.values()) < cell["us_per_call"] and phases["launch"] > 0
        assert "host_phases_us" not in r["cells"]["eager"]
    printed = capsys.readouterr().out
    assert "host time of a small call by phase" in printed and "outside" in printed


def test_interleave_is_the_cpu_default_and_needs_systems_that_run_side_by_side():
    assert cli.parse_args(["--device", "cpu"]).interleave is True
    assert cli.parse_args(["--device", "cpu", "--no-interleave"]).interleave is False
    from fuser.bench.systems import INTERLEAVED_SYSTEMS
    assert "ts_nnc" not in INTERLEAVED_SYSTEMS and "ts_legacy" not in INTERLEAVED_SYSTEMS


def test_interleaved_rounds_time_each_system_in_turn_and_rotate(monkeypatch):
    """A row's systems built and checked first, then a batch of each per round, the order rotated each round;
    every cell its rounds' samples and their median, its first call checked against eager's; a system that fails
    in a round keeps its error and leaves the rounds, the others go on."""
    import statistics

    import torch

    from fuser.bench import rows
    from fuser.bench.timing import QUICK
    from fuser.bench.workloads import WORKLOADS

    wl = next(w for w in WORKLOADS if w.name == "mul_add")
    order, real = [], rows._samples

    def samples(fn, size, sets, device, cfg, cell):
        assert cfg.batches == 1 and cfg.host_repeats == 1
        order.append(fn.system)
        return real(fn, size, sets, device, cfg, cell)

    from fuser.bench import systems as bench_systems
    contexts = dict(bench_systems.SYSTEM_CONTEXTS)

    def tagged(system, fail_in_round=None):
        def context(w):
            import contextlib

            @contextlib.contextmanager
            def cm():
                with contexts[system](w) as fn:
                    def call(*a):
                        if fail_in_round is not None and order.count(system) > fail_in_round:
                            raise RuntimeError("planted failure")
                        return fn(*a)
                    call.system = system
                    yield call
            return cm()
        return context

    monkeypatch.setattr(rows, "_samples", samples)
    monkeypatch.setitem(rows.SYSTEM_CONTEXTS, "eager", tagged("eager"))
    monkeypatch.setitem(rows.SYSTEM_CONTEXTS, "fuser", tagged("fuser"))
    cfg = QUICK
    row = rows.run_row(wl, torch.float32, "small", ["eager", "fuser"], torch.device("cpu"), cfg, True, 1e10, True)
    assert order == [s for r in range(cfg.host_repeats) for s in (("eager", "fuser"), ("fuser", "eager"))[r % 2]]
    for s in ("eager", "fuser"):
        cell = row["cells"][s]
        assert cell["interleaved"] and "error" not in cell and cell["mismatch"] is False
        assert len(cell["host_us_samples"]) == cfg.host_repeats
        assert cell["us_per_call"] == statistics.median(cell["host_us_samples"])
    order.clear()
    monkeypatch.setitem(rows.SYSTEM_CONTEXTS, "eager", tagged("eager", fail_in_round=1))
    row = rows.run_row(wl, torch.float32, "small", ["eager", "fuser"], torch.device("cpu"), cfg, True, 1e10, True)
    assert "planted failure" in row["cells"]["eager"]["error"] and "us_per_call" not in row["cells"]["eager"]
    assert len(row["cells"]["fuser"]["host_us_samples"]) == cfg.host_repeats and "error" not in row["cells"]["fuser"]


def test_a_cells_process_usage_per_call():
    """Each timed cell carries what the process did per call (getrusage over its timed calls): a call that sleeps
    switches out voluntarily about once and uses little processor time; a call that writes fresh memory faults pages
    in. The figures are per call of the cell, over every timed call."""
    import time

    import mmap

    import torch

    from fuser.bench import rows
    from fuser.bench.timing import QUICK

    def cell_of(fn):
        cell = {}
        for _ in range(QUICK.host_repeats):
            rows._samples(fn, "small", [()], torch.device("cpu"), QUICK, cell)
        rows._usage_per_call(cell)
        return cell["process_per_call"]

    sleeping = cell_of(lambda: time.sleep(0.001))
    assert sleeping["voluntary_switches"] >= 0.9 and sleeping["user_us"] < 500, sleeping
    def write_fresh_pages():  # 1 MB mapped anew and written a byte a page
        with mmap.mmap(-1, 1 << 20) as m:
            for i in range(0, 1 << 20, 4096):
                m[i] = 1
    writing = cell_of(write_fresh_pages)
    assert writing["minor_faults"] >= 100, writing
    assert writing["threads"] >= 1 and writing["machine_steal_us"] >= 0 and "_usage" not in sleeping


def test_a_run_starts_the_compilers_caches_empty_unless_asked_to_keep_them(monkeypatch, tmp_path):
    """By default every cache a first call could find a kernel in (fuser's, Inductor's, Triton's, the CUDA
    driver's, which NVRTC uses too) names an empty directory during the run, and is restored after it; with
    --warm-caches the run keeps the user's."""
    import os
    seen, off = [], []

    def fake_main(args):
        seen.append({var: os.environ.get(var) for var in cli.COLD_CACHES})
        for path in seen[-1].values():
            assert path is None or not os.path.exists(path) or not os.listdir(path)
        off.append(os.environ.get("CUDA_CACHE_DISABLE"))
        return 0

    monkeypatch.setattr(cli, "_main", fake_main)
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_CACHE_PATH", raising=False)
    monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)
    assert cli.main(["--device", "cpu"]) == 0
    cold = seen[-1]
    assert all(cold.values()) and len({os.path.dirname(p) for p in cold.values()}) == 1
    assert cold["FUSER_CACHE_DIR"] != str(tmp_path) and not os.path.exists(os.path.dirname(cold["FUSER_CACHE_DIR"]))
    assert os.environ["FUSER_CACHE_DIR"] == str(tmp_path) and "CUDA_CACHE_PATH" not in os.environ
    assert cli.main(["--device", "cpu", "--warm-caches"]) == 0
    assert seen[-1]["FUSER_CACHE_DIR"] == str(tmp_path) and seen[-1]["CUDA_CACHE_PATH"] is None
    assert off == ["1", None] and "CUDA_CACHE_DISABLE" not in os.environ


def test_each_fuser_system_s_first_call_compiles_its_own_kernel(tmp_path):
    """The TorchScript pass and the torch.compile backend make the same group for mul_add; run side by side, the
    second one's first call still compiles the kernel (nothing from the first's in memory or on disk), and both
    give eager's result."""
    out = tmp_path / "rows.json"
    assert cli.main(["--device", "cpu", "--quick", "--only", "=mul_add", "--sizes", "large",
                     "--systems", "fuser,compile_fuser", "--interleave", "--json", str(out),
                     "--png", str(tmp_path / "chart.png")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows
    for r in rows:
        for system in ("fuser", "compile_fuser"):
            cell = r["cells"][system]
            assert "error" not in cell and not cell["mismatch"], cell
            assert cell["kernels_compiled_first_call"] == 1 and len(cell["kernel_build_ms"]) == 1, (system, cell)
