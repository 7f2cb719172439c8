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
