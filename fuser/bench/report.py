"""The benchmark's report: the table on stdout, fuser's first calls, the chart, and the versions recorded in the
JSON."""
from __future__ import annotations

import contextlib
import math
import platform
from typing import Optional, Sequence

import torch

import fuser

from .cpu import cpu_cell_text


def _cell_text(row: dict, system: str) -> str:
    cell = row["cells"].get(system)
    if cell is None:
        return "-"
    if "error" in cell:
        return "ERR"
    flag = "!" if cell.get("mismatch") else ""
    if row.get("device_type") == "cpu":
        return cpu_cell_text(row, cell, flag)
    if row["size"] == "large":
        return f"{cell['fraction_of_floor']:.2f} ({cell['us_per_call']:.0f}us){flag}"
    return f"{cell['us_per_call']:.1f}us{flag}"


def format_table(rows: list[dict], systems: Sequence[str]) -> str:
    """One line per row, one column per system: large rows 'fraction of floor (µs per call)', small rows
    host µs per call. '!' marks a result that differs from eager's beyond tolerance."""
    header = ["workload", "dtype", "size", *systems]
    lines = [[r["workload"], r["dtype"], r["size"], *(_cell_text(r, s) for s in systems)] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    out = [fmt(header), fmt(["-" * w for w in widths]), *(fmt(l) for l in lines)]
    errors = [f"  {r['workload']}/{r['dtype']}/{r['size']}/{s}: {c['error'].splitlines()[0][:200]}"
              for r in rows for s, c in r["cells"].items() if "error" in c]
    if errors:
        out += ["", "errors:", *errors]
    mismatches = [f"  {r['workload']}/{r['dtype']}/{r['size']}/{s}: max abs err {c['max_abs_err']:.3g}"
                  for r in rows for s, c in r["cells"].items() if c.get("mismatch")]
    if mismatches:
        out += ["", "results differing from eager:", *mismatches]
    return "\n".join(out)


def host_phases_table(rows: list[dict], systems: Sequence[str]) -> str:
    """Small rows: where a fused call's host time goes, per call of the workload's function (µs): the whole
    (the row's median), the native hot path's phases (``fuser.native.PHASES``) and the rest ("outside": the
    caller, TorchScript's interpreter or the FX graph, the dispatcher's way into the op, Python's fallback when
    the call was not served natively); "served" counts the calls served natively per call. Empty when no
    cell has phases."""
    from fuser import native
    header = ["workload", "dtype", "system", "host", "served", "outside", *native.PHASES]
    lines = []
    for r in rows:
        for system in systems:
            c = r["cells"].get(system, {})
            ph = c.get("host_phases_us")
            if ph is None or "us_per_call" not in c:
                continue
            lines.append([r["workload"], r["dtype"], system, f"{c['us_per_call']:.1f}",
                          f"{c['native_calls_per_call']:.2f}", f"{c['us_per_call'] - sum(ph.values()):.1f}",
                          *(f"{ph[p]:.2f}" for p in native.PHASES)])
    if not lines:
        return ""
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    return "\n".join(["host time of a small call by phase (us per call; the native hot path's phases, the rest "
                      "outside it):", fmt(header), fmt(["-" * w for w in widths]), *(fmt(l) for l in lines)])


def fuser_first_calls(rows: list[dict]) -> dict:
    """Per 'workload/dtype': fuser's first-call wall time (ms) from the first row that ran it, the one where
    its kernels were compiled (a later size with the same arg spec reuses them)."""
    result = {}
    for r in rows:
        cell = r["cells"].get("fuser", {})
        key = f"{r['workload']}/{r['dtype']}"
        if key not in result and "first_call_ms" in cell:
            result[key] = {"ms": cell["first_call_ms"], "size": r["size"],
                           "kernels_compiled": cell["kernels_compiled_first_call"],
                           "kernel_build_ms": cell.get("kernel_build_ms", [])}
    return result


COMPILING = ("compile", "compile_fuser", "fuser")  # systems whose first call compiles


def first_call_table(rows: list[dict], systems: Sequence[str]) -> str:
    """Per 'workload/dtype', the first call's wall time (ms, compile included) of each compiling system, from the
    first row that ran it; empty when fewer than two compiling systems ran."""
    shown = [s for s in COMPILING if s in systems]
    if len(shown) < 2:
        return ""
    seen, lines = set(), ["first call ms (compile included): " + ", ".join(shown)]
    for r in rows:
        key = f"{r['workload']}/{r['dtype']}"
        if key in seen:
            continue
        seen.add(key)
        cells = [r["cells"].get(s, {}).get("first_call_ms") for s in shown]
        lines.append(f"  {key:<24} " + "  ".join("-".rjust(9) if ms is None else f"{ms:9.1f}" for ms in cells))
    return "\n".join(lines)


def draw_chart(rows: list[dict], systems: Sequence[str], path: str, title: str, per_panel: int = 30) -> Optional[str]:
    """Grouped horizontal bars of the large rows' fraction of floor, in panels side by side of at most
    ``per_panel`` rows each (a row a line, labelled with its workload and dtype); returns why it was skipped, or
    None."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    large = [r for r in rows if r["size"] == "large"]
    if not large:
        return "no large rows"
    n_panels = -(-len(large) // per_panel)
    per = -(-len(large) // n_panels)  # rows spread evenly over the panels
    height = 0.8 / len(systems)
    fig, axes = plt.subplots(1, n_panels, figsize=(6.0 * n_panels, 0.32 * per + 1.6), squeeze=False)
    for p, ax in enumerate(axes[0]):
        part = large[p * per:(p + 1) * per]
        for k, system in enumerate(systems):
            widths = [r["cells"].get(system, {}).get("fraction_of_floor", math.nan) for r in part]
            ax.barh([i + (k - (len(systems) - 1) / 2) * height for i in range(len(part))], widths, height,
                    label=system, color=f"C{k}")
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(part)))
        ax.set_yticklabels([f"{r['workload']} {r['dtype']}" for r in part], fontsize=7)
        ax.set_ylim(len(part) - 0.5, -0.5)  # the first row on top
        ax.set_xlim(0, 1.15)
        ax.set_xlabel("fraction of copy-bandwidth floor", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", linewidth=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(systems), fontsize=8)
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _versions() -> dict:
    info = {"torch": torch.__version__, "fuser": fuser.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda}
    with contextlib.suppress(Exception):
        import triton
        info["triton"] = triton.__version__
    return info
