"""The scaling benchmark's results: speedups and byte ratios per run, the table, the plot and the JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from engine import codecs

from . import fleet
from .config import (
    BANDWIDTH_MBIT,
    GOAL_BUSY,
    GOAL_BYTES,
    GOAL_BYTES_4BIT,
    GOAL_HETERO_AT,
    GOAL_HETERO_SPEEDUP,
    GOAL_SPEEDUP,
    LATENCY_MS,
    METHODS,
    Options,
)
from .emulation import Emulation

Row = dict[str, Any]
HEAD = (
    "method",
    "N",
    "t->target s",
    "speedup",
    "versions",
    "s/round",
    "per round",
    "samples",
    "bytes/sample",
    "total bytes",
    "vs sync",
    "real>emu",
    "load",
)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


# --- derived numbers -----------------------------------------------------------------------------------


def summarize(rows: list[Row]) -> None:
    for r in rows:
        r["seconds_per_round"] = (
            round(r["seconds_to_target"] / r["versions_to_target"], 2) if r["reached"] else None
        )
    base = {r["method"]: r for r in rows if r["volunteers"] == 1 and r["reached"]}
    sync = {r["volunteers"]: r for r in rows if r["method"] == "sync" and r["reached"]}
    for r in rows:
        r.update(_speedups(r, base.get(r["method"])))
        r.update(_bytes_vs_sync(r, sync.get(r["volunteers"])))


def _speedups(row: Row, base: Row | None) -> dict[str, float | None]:
    """Time to target over one volunteer's, and the same per round: one algorithm needs the same rounds
    whatever N, up to noise near the target (int8 rounding differs with who computed what)."""
    if base is None or not row["reached"]:
        return {"speedup": None, "round_speedup": None}
    return {
        "speedup": round(base["seconds_to_target"] / row["seconds_to_target"], 2),
        "round_speedup": round(base["seconds_per_round"] / row["seconds_per_round"], 2),
    }


def _bytes_vs_sync(row: Row, sync: Row | None) -> dict[str, float | None]:
    if sync is None or not row["reached"]:
        return {"bytes_vs_sync": None, "bytes_per_sample_vs_sync": None}
    return {
        "bytes_vs_sync": round(row["training_bytes_to_target"] / sync["training_bytes_to_target"], 4),
        "bytes_per_sample_vs_sync": round(row["bytes_per_sample"] / sync["bytes_per_sample"], 4),
    }


def resnet18_bytes(work_units: dict[str, int]) -> dict[str, Any]:
    """Real encoded sizes (engine.codecs) of ResNet-18-shaped random tensors; bytes per sample for one
    upload plus one weights download (in the same codec) per work unit."""
    sizes = _resnet18_sizes()
    rows = {}
    for name, (samples, codec) in {
        "sync fp32": (work_units["sync"], "fp32"),
        "avg int8": (work_units["avg"], "int8"),
        "avg fp32": (work_units["avg"], "fp32"),
    }.items():
        up, down = sizes[f"update_{codec}"], sizes[f"weights_{codec}"]
        rows[name] = {
            "samples_per_work_unit": samples,
            "upload_bytes": up,
            "download_bytes": down,
            "upload_bytes_per_sample": round(up / samples, 1),
            "bytes_per_sample": round((up + down) / samples, 1),
        }
    return {"sizes": sizes, "per_method": rows}


def _resnet18_sizes() -> dict[str, int]:
    from engine.presets import build_preset

    model = build_preset("resnet18")
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in model.named_parameters()}
    state = {
        n: torch.randn(t.shape, generator=gen) if t.is_floating_point() else t
        for n, t in model.state_dict().items()
    }
    sizes = {
        "params": sum(t.numel() for t in params.values()),
        "update_fp32": len(codecs.encode(params, "fp32")),
        "update_int8": len(codecs.encode(params, "int8")),
    }
    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    sizes.update({f"weights_{codec}": len(codecs.encode(floats, codec)) for codec in ("fp32", "int8")})
    return sizes


# --- printed -------------------------------------------------------------------------------------------


def run_line(row: Row, target: float) -> str:
    """One run's outcome, printed as soon as it ends."""
    return (
        f"  -> {'reached' if row['reached'] else 'NOT reached'} {target:.0%} in "
        f"{row['seconds_to_target']} s, v{row['versions_to_target']}, "
        f"best {row['best_accuracy']:.1%}, {fmt_bytes(row['training_bytes_to_target'])}, "
        f"real>emulated {row['compute_real_over_emulated']}"
        f"/{row['work_units_all']}, outcomes {row['result_outcomes']}, setup {row['setup_seconds']} s"
        + (f", CRASHED {row['crashed']}" if row["crashed"] else "")
    )


def _table_cells(r: Row) -> tuple[str, ...]:
    return (
        r["method"],
        str(r["volunteers"]),
        f"{r['seconds_to_target']:.1f}"
        if r["reached"]
        else f">{r['run_seconds']:.0f} ({r['best_accuracy']:.0%})",
        f"{r['speedup']:.2f}x" if r.get("speedup") else "-",
        str(r["versions_to_target"] or "-"),
        f"{r['seconds_per_round']:.2f}" if r.get("seconds_per_round") else "-",
        f"{r['round_speedup']:.2f}x" if r.get("round_speedup") else "-",
        str(r["samples_aggregated_to_target"] or "-"),
        fmt_bytes(r["bytes_per_sample"]),
        fmt_bytes(r["training_bytes_to_target"]),
        f"{r['bytes_vs_sync']:.2%}" if r.get("bytes_vs_sync") is not None else "-",
        f"{r['compute_real_over_emulated']}/{r['work_units_all']}"
        + (" !" if r["compute_real_over_emulated"] else ""),
        f"{r['load_average_before']:.1f}",
    )


def print_table(rows: list[Row]) -> None:
    lines = [HEAD, *(_table_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEAD))]
    for i, line in enumerate(lines):
        cells = zip(line, widths, strict=True)
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(cells)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def print_summary(rows: list[Row], resnet: dict[str, Any]) -> None:
    print()
    print_table(rows)
    print("\nResNet-18-sized updates (engine.codecs on random tensors):", json.dumps(resnet["sizes"]))
    for name, r in resnet["per_method"].items():
        print(
            f"  {name:10s} WU {r['samples_per_work_unit']:5d}: up {fmt_bytes(r['upload_bytes'])} + down "
            f"{fmt_bytes(r['download_bytes'])} -> {r['bytes_per_sample']:.0f} B/sample "
            f"(upload only {r['upload_bytes_per_sample']:.0f} B/sample)"
        )
    flagged = [r for r in rows if r["compute_real_over_emulated"]]
    if flagged:
        print(
            "\n! real compute exceeded the emulated device time in:",
            ", ".join(
                f"{r['method']} N={r['volunteers']} ({r['compute_real_over_emulated']}/{r['work_units_all']},"
                f" max x{r['compute_real_over_emulated_max_ratio']})"
                for r in flagged
            ),
        )


# --- written -------------------------------------------------------------------------------------------


def result(
    options: Options, emulation: Emulation, rows: list[Row], resnet: dict[str, Any], wall: float
) -> Row:
    """The results file's content."""
    return {
        "benchmark": "scaling",
        "quick": options.quick,
        "target_accuracy": options.target,
        "emulation": {
            "gflops_per_volunteer": emulation.gflops,
            "bandwidth_mbit": BANDWIDTH_MBIT,
            "latency_ms": LATENCY_MS,
            "calibration": emulation.calibration,
            "device_nice": emulation.device_nice,
            "device_processes": emulation.device_processes,
            "prefetch": emulation.prefetch,
            "note": "each volunteer computes for real (in device_processes processes beside the harness, "
            "or its threads if 0, at the CPU priority device_nice) and answers no sooner "
            "than samples x flops_per_sample / gflops; dataset shards are pre-cached (immutable "
            "blobs, 28 MB once per volunteer) and not counted; bytes = all WebSocket frames + "
            "weights/graph downloads",
        },
        "methods": {k: {"label": m.label, "why": m.why} for k, m in METHODS.items() if k in options.methods},
        "goals": {
            "speedup_at_16": GOAL_SPEEDUP,
            "bytes_vs_fp32_sync": GOAL_BYTES,
            "bytes_vs_fp32_sync_avg_4bit": GOAL_BYTES_4BIT,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "wall_seconds": wall,
        "runs": rows,
        "resnet18": resnet,
    }


def write(path: Path, content: Row, rows: list[Row], target: float) -> None:
    """The JSON and, next to it, the plot."""
    path.write_text(json.dumps(content, indent=1) + "\n")
    plot(rows, path.with_suffix(".png"), target)


def replot(path: Path) -> None:
    """Only the summary, table and plot again, from a results file."""
    saved = json.loads(path.read_text())
    summarize(saved["runs"])
    print_table(saved["runs"])
    write(path, saved, saved["runs"], saved["target_accuracy"])


# --- plotted -------------------------------------------------------------------------------------------


def plot(rows: list[Row], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    methods = sorted({r["method"] for r in rows}, key=list(METHODS).index)
    ns = sorted({r["volunteers"] for r in rows})
    _plot_speedups(ax1, rows, methods, ns, target)
    _plot_bytes(ax2, rows, methods, ns)
    fig.suptitle(
        f"Crowdtrain Fashion-MNIST MLP, 100 Mbit/s + 20 ms per volunteer, target {target:.0%} test accuracy"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_speedups(ax: Any, rows: list[Row], methods: list[str], ns: list[int], target: float) -> None:
    ax.plot(ns, ns, "k:", label="linear")
    ax.axhline(GOAL_SPEEDUP, color="grey", lw=0.8, ls="--", label=f"goal {GOAL_SPEEDUP:g}x @16")
    for m in methods:
        ours = [r for r in rows if r["method"] == m and r.get("speedup")]
        if not ours:
            continue
        xs = [r["volunteers"] for r in ours]
        line = ax.plot(xs, [r["speedup"] for r in ours], "o-", label=METHODS[m].label)[0]
        # Per round too: rounds-to-target may differ by one between runs (int8 rounding), which moves
        # the time-to-accuracy speedup by a round's worth either way.
        per_round = [r["round_speedup"] for r in ours]
        ax.plot(xs, per_round, "x--", color=line.get_color(), alpha=0.6, label=f"{m}, per round")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="volunteers",
        ylabel=f"speedup in time to {target:.0%}",
        title="Time-to-accuracy speedup over 1 volunteer",
    )
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_yticks([0.5, 1, 2, 4, 8, 16], ["0.5", "1", "2", "4", "8", "16"])
    ax.minorticks_off()
    ax.legend(fontsize=8)


def _plot_bytes(ax: Any, rows: list[Row], methods: list[str], ns: list[int]) -> None:
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        pts = [
            (r["volunteers"], r["bytes_per_sample"])
            for r in rows
            if r["method"] == m and r["bytes_per_sample"]
        ]
        if pts:
            xs = [ns.index(n) + (i - (len(methods) - 1) / 2) * width for n, _ in pts]
            bars = ax.bar(xs, [b for _, b in pts], width, label=METHODS[m].label)
            ax.bar_label(bars, [fmt_bytes(b) for _, b in pts], fontsize=7, rotation=90, padding=2)
    ax.set_xticks(range(len(ns)), [str(n) for n in ns])
    ax.set(
        yscale="log",
        xlabel="volunteers",
        ylabel="bytes on the wire per trained sample (log)",
        title="Traffic (weights down + updates up) per aggregated sample",
    )
    ax.margins(y=0.3)
    ax.legend(fontsize=7, loc="center", framealpha=0.9)


# --- the heterogeneous runs (issue 15 items 7 and 5) -----------------------------------------------------

HETERO_HEAD = (
    "method",
    "N",
    "t->target s",
    "versions",
    "samples",
    "1 mean volunteer s",
    "speedup",
    "efficiency",
    "busy median",
    "busy p10",
    "steady median",
    "steady p10",
    "1st unit wait p90 / max s",
    "round s",
    "start p90 ms",
    "left/joined",
    "real>emu",
    "load",
)


def _hetero_cells(r: Row) -> tuple[str, ...]:
    base, busy, churn = r["baseline"], r["busy"], r["churn"]["done"]
    rounds = r.get("rounds") or {}  # runs before rounds were measured have none
    steady = busy.get("steady") or {}  # nor steady-state busy fractions
    return (
        r["method"],
        str(r["volunteers"]),
        f"{r['seconds_to_target']:.1f}"
        if r["reached"]
        else f">{r['run_seconds']:.0f} ({r['best_accuracy']:.0%})",
        str(r["versions_to_target"] or "-"),
        str(r["samples_aggregated_to_target"] or "-"),
        f"{base['one_mean_volunteer_seconds']:.0f}" if base["speedup"] else "-",
        f"{base['speedup']:.1f}x" if base["speedup"] else "-",
        f"{base['efficiency']:.2f}" if base["speedup"] else "-",
        f"{busy['busy_median']:.1%}" if busy["busy_median"] is not None else "-",
        f"{busy['busy_p10']:.1%}" if busy["busy_p10"] is not None else "-",
        _cell(steady.get("busy_median"), "{:.1%}"),
        _cell(steady.get("busy_p10"), "{:.1%}"),
        _wait_cell(busy.get("first_unit_wait_s") or {}),  # runs before it was measured have none
        _cell(rounds.get("seconds_median"), "{:.2f}"),
        _cell(rounds.get("start_ms_p90_median"), "{:.0f}"),
        f"{sum('left_s' in e for e in churn)}/{sum('joined_s' in e for e in churn)}",
        f"{r['compute_real_over_emulated']}/{r['work_units_all']}",
        f"{r['load_average_before']:.1f}",
    )


def _wait_cell(waits: dict[str, float | None]) -> str:
    if waits.get("p90") is None:
        return "-"
    return f"{waits['p90']:.1f} / {waits['max']:.1f}"


def _cell(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def print_heterogeneous(rows: list[Row]) -> None:
    lines = [HETERO_HEAD, *(_hetero_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HETERO_HEAD))]
    print()
    for i, line in enumerate(lines):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def heterogeneous_result(options: Options, emulation: Emulation, rows: list[Row], wall: float) -> Row:
    """The heterogeneous results file's content."""
    content = result(options, emulation, rows, {}, wall)
    del content["resnet18"]
    content["benchmark"] = "scaling-heterogeneous"
    content["emulation"].update(
        gflops_per_volunteer=None,
        top_gflops=emulation.gflops,
        fleet=fleet.__doc__.split("\n\n")[1].replace("\n", " ") if fleet.__doc__ else "",
        churn=fleet.__doc__.split("\n\n")[2].replace("\n", " ") if fleet.__doc__ else "",
        busy=fleet.__doc__.split("\n\n")[3].replace("\n", " ") if fleet.__doc__ else "",
    )
    content["goals"] = {
        f"speedup_at_{GOAL_HETERO_AT}": GOAL_HETERO_SPEEDUP,
        "busy_fraction_median_and_p10": GOAL_BUSY,
        "baseline": "one volunteer of the fleet's mean speed computing the samples aggregated up to the "
        "target back to back (no network, server or waiting): runner.baseline",
    }
    return content


def write_heterogeneous(path: Path, content: Row, rows: list[Row]) -> None:
    path.write_text(json.dumps(content, indent=1) + "\n")
    plot_heterogeneous(rows, path.with_suffix(".png"), content["target_accuracy"])


def replot_heterogeneous(path: Path) -> None:
    saved = json.loads(path.read_text())
    print_heterogeneous(saved["runs"])
    write_heterogeneous(path, saved, saved["runs"])


def plot_heterogeneous(rows: list[Row], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    _plot_hetero_speedups(ax1, rows, target)
    _plot_busy(ax2, rows)
    fig.suptitle(
        f"Crowdtrain Fashion-MNIST MLP to {target:.0%}: volunteers 10x apart in speed, "
        f"{rows[0]['churn']['rate_per_hour']:.0%} churn per hour"
        if rows
        else "no runs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_hetero_speedups(ax: Any, rows: list[Row], target: float) -> None:
    ns = sorted({r["volunteers"] for r in rows})
    ax.plot([1, *ns], [1, *ns], "k:", label="linear")
    ax.plot([GOAL_HETERO_AT], [GOAL_HETERO_SPEEDUP], "k*", ms=10, label=f"goal {GOAL_HETERO_SPEEDUP:g}x")
    for method in dict.fromkeys(r["method"] for r in rows):
        ours = [r for r in rows if r["method"] == method and r["baseline"]["speedup"]]
        ax.plot([r["volunteers"] for r in ours], [r["baseline"]["speedup"] for r in ours], "o-", label=method)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="volunteers",
        ylabel=f"speedup in time to {target:.0%}",
        title="Over one volunteer of the fleet's mean speed",
    )
    ax.legend(fontsize=8)


def _plot_busy(ax: Any, rows: list[Row]) -> None:
    for r in rows:
        pairs = r["busy"]["per_device_gflops_busy"]
        label = f"{r['method']} N={r['volunteers']}"
        ax.plot([g for g, _ in pairs], [b for _, b in pairs], "o", ms=3, label=label)
    ax.axhline(GOAL_BUSY, color="grey", lw=0.8, ls="--", label=f"goal {GOAL_BUSY:.0%}")
    ax.set(
        xscale="log",
        xlabel="device speed (emulated GFLOP/s)",
        ylabel="share of wall time computing",
        title="Each device's busy fraction at steady state",
    )
    ax.legend(fontsize=8)
