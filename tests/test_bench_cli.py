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
    rows = json.loads(out.read_text())["rows"]
    assert rows and {r["size"] for r in rows} == {"small"} and {r["workload"] for r in rows} == {"mul_add"}


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
