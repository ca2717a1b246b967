"""The pipeline benchmark's tables and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.scaling.report import fmt_bytes

Row = dict[str, Any]


def print_all(result: Row) -> None:
    print("EMULATION: " + result["assumptions"]["emulated"])
    print_models(result["models"])
    print_pipeline(result["runs"])
    print_bubbles(result["bubbles"])
    print_crossover(result["runs"], result["crossover"])
    print_churn(result["churn"])
    print_verdict(result["verdict"])


def print_models(models: list[Row]) -> None:
    print(f"\n{'model':10s} {'params':>9s} {'GFLOP/sample':>12s} {'one device':>11s}  data parallel")
    for m in models:
        fits = "fits" if m["fits_one_device"] else "over budget"
        print(
            f"{m['name']:10s} {fmt_bytes(m['params']):>9s} {m['train_flops'] / 1e9:12.2f} "
            f"{m['one_device_bytes'] / 2**20:8.0f} MiB  {fits}"
        )


def print_pipeline(rows: list[Row]) -> None:
    print(
        f"\n{'model':10s} {'S':>2s} {'v':>2s} {'samples/s':>9s} {'relay':>7s} {'sync':>7s} {'avg':>7s} "
        f"{'bubble':>6s} {'fill':>6s} {'GPipe':>6s} {'w/links':>7s} {'act fp16/smp':>12s} {'w+g/smp':>9s} "
        f"{'sync/smp':>9s} {'srv ring':>9s} {'srv relay':>9s}"
    )
    dp = {(r["model"], r["method"], r["volunteers"]): r for r in rows if r["method"] != "pipeline"}
    for r in (r for r in rows if r["method"] == "pipeline"):
        sync, avg = (dp.get((r["model"], m, r["volunteers"])) for m in ("sync", "averaging"))
        b = r["bytes_fp16"]
        print(
            f"{r['model']:10s} {r['stages']:2d} {r['per_stage']:2d} {r['samples_per_s']:9.1f} "
            f"{r['samples_per_s_relay']:7.1f} {_rate(sync):>7s} {_rate(avg):>7s} {r['bubble']:6.3f} "
            f"{r['bubble_fill_drain']:6.3f} {r['bubble_formula']:6.3f} {r['bubble_with_links']:7.3f} "
            f"{fmt_bytes(b['activations']):>12s} {fmt_bytes(b['weights_gradients']):>9s} "
            f"{fmt_bytes(r['sync_bytes']):>9s} {fmt_bytes(b['server_ring']):>9s} "
            f"{fmt_bytes(b['server_relay']):>9s}"
        )


def print_bubbles(rows: list[Row]) -> None:
    """Measured idle share / GPipe's (S-1)/(M+S-1) per model, S and M; * where more than 10% off."""
    ms = sorted({r["micro_batches"] for r in rows})
    print(
        "\nbubble, one volunteer per stage, equal speeds, no link time: measured / GPipe (S-1)/(M+S-1)"
        " (* more than 10% over, < more than 10% under); the cuts make the shortest step of M; last"
        " columns: M=16 with the smallest-bottleneck cuts alone, and how much shorter the step is"
    )
    print(
        f"{'model':10s} {'S':>2s} "
        + " ".join(f"{'M=' + str(m):>13s}" for m in ms)
        + "  balance  old cuts  shorter"
    )
    for model, s in dict.fromkeys((r["model"], r["stages"]) for r in rows):
        mine = {r["micro_batches"]: r for r in rows if (r["model"], r["stages"]) == (model, s)}
        cells = [f"{mine[m]['bubble']:.3f}/{mine[m]['formula']:.3f}{_mark(mine[m])}" for m in ms]
        at = mine[max(m for m in ms if m <= 16)]
        print(
            f"{model:10s} {s:2d} "
            + " ".join(f"{c:>13s}" for c in cells)
            + f"  {at['balance']:7.3f}  {at['bubble_bottleneck_cuts']:8.3f}"
            + f"  {at['step_shorter_than_bottleneck_cuts']:6.1%}"
        )


def _mark(row: Row) -> str:
    return "*" if row["over_10pct"] else "<" if row["under_10pct"] else " "


def print_verdict(v: Row) -> None:
    print(
        f"\nwidest GPT that fits one device: {v['widest_fitting_one_device']}; "
        "pipeline vs sync, same volunteers:"
    )
    for r in v["pipeline_vs_sync_same_volunteers"]:
        print(
            f"  S={r['stages']} x {r['per_stage']}: {r['samples_per_s']:.1f} "
            f"against {r['sync_samples_per_s']:.1f} samples/s"
        )
    print(f"  pipeline beats sync in every configuration: {v['pipeline_beats_sync_everywhere']}")
    print(f"bubble at most 10% over GPipe's at M=16: {v['bubble_at_most_10pct_over']}")
    print(f"  more than 10% over: {v['bubble_more_than_10pct_over']}")


def _rate(row: Row | None) -> str:
    return "-" if row is None else f"{row['samples_per_s']:.1f}"


def wire(row: Row, codec: str) -> float:
    b = row[f"bytes_{codec}"]
    return float(b["activations"] + b["weights_gradients"])


def crossover(rows: list[Row], codec: str) -> list[Row]:
    """Per (model, S, v): pipeline's bytes on the wire per sample against data-parallel sync's."""
    out = []
    for r in (r for r in rows if r["method"] == "pipeline"):
        out.append(
            {
                "model": r["model"],
                "stages": r["stages"],
                "per_stage": r["per_stage"],
                "pipeline": wire(r, codec),
                "sync": r["sync_bytes"],
                "fewer": wire(r, codec) < r["sync_bytes"],
            }
        )
    return out


def smallest_widths(rows: list[Row]) -> list[Row]:
    """Per codec and (S, v): the narrowest GPT from which pipelining moves fewer bytes than sync."""
    out = []
    for codec in ("fp32", "fp16"):
        table = [r for r in crossover(rows, codec) if r["model"].startswith("gpt")]
        for s, v in sorted({(r["stages"], r["per_stage"]) for r in table}):
            mine = [r for r in table if (r["stages"], r["per_stage"]) == (s, v)]
            fewer = [int(r["model"].split("-")[1]) for r in mine if r["fewer"]]
            widths = sorted(int(r["model"].split("-")[1]) for r in mine)
            from_ = next((w for w in widths if all(x in fewer for x in widths if x >= w)), None)
            out.append({"codec": codec, "stages": s, "per_stage": v, "fewer_from_width": from_})
    return out


def print_crossover(rows: list[Row], widths: list[Row]) -> None:
    print(
        "\nbytes on the wire per sample, pipeline (activations + stage weights/gradients) over data-parallel "
        "sync (weights/gradients), same volunteers, same 64-sample step; data excluded from both:"
    )
    for codec in ("fp32",):
        table = crossover(rows, codec)
        models = list(dict.fromkeys(r["model"] for r in table))
        print(f"  activations {codec}: " + "  ".join(f"{m}" for m in models))
        for s, v in sorted({(r["stages"], r["per_stage"]) for r in table}):
            ratios = {
                r["model"]: r["pipeline"] / r["sync"]
                for r in table
                if (r["stages"], r["per_stage"]) == (s, v)
            }
            print(
                f"    S={s} v={v}: "
                + "  ".join(f"{m}={ratios[m]:.2f}" if m in ratios else f"{m}=-" for m in models)
            )
    print("  narrowest GPT d_model from which pipelining moves fewer bytes than sync, per S x v:")
    for codec in ("fp32", "fp16"):
        cells = [
            f"{w['stages']}x{w['per_stage']}:{w['fewer_from_width'] or '-'}"
            for w in widths
            if w["codec"] == codec
        ]
        print(f"    {codec}: " + " ".join(cells))


def print_churn(rows: list[Row]) -> None:
    print("\nthroughput kept while volunteers leave and join (20%/min each way):")
    for r in rows:
        print(
            f"  {r['model']:9s} S={r['stages']} v={r['per_stage']} gradients {r['gradients']:8s}: "
            f"{r['kept']:.1%} kept (trials {', '.join(f'{k:.1%}' for k in r['kept_trials'])}), "
            f"{r['base_samples_per_s']:.1f} samples/s without churn, "
            f"{r['lost_volunteer_s_per_step']:.2f} volunteer-s lost per step"
        )


# ---------------------------------------------------------------- plot


def plot(result: Row, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["runs"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    _plot_throughput(axes[0][0], rows)
    _plot_bytes(axes[0][1], rows)
    _plot_bubble(axes[1][0], result["bubbles"])
    _plot_server(axes[1][1], rows)
    fig.suptitle(
        "Pipeline vs data parallel, EMULATED time (FLOPs at phone/laptop/desktop speeds, 100 Mbit/s + 20 ms),"
        " real graphs and partitions"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _gpts(rows: list[Row]) -> list[str]:
    return [m for m in dict.fromkeys(r["model"] for r in rows) if m.startswith("gpt")]


def _plot_throughput(ax: Any, rows: list[Row]) -> None:
    names = _gpts(rows)
    xs = range(len(names))
    for s, v in ((4, 4), (8, 2)):  # 16 volunteers, as the data-parallel lines
        ys = [_find(rows, "pipeline", m, stages=s, per_stage=v) for m in names]
        ax.plot(
            xs, [y["samples_per_s"] if y else None for y in ys], "o-", label=f"pipeline S={s} x {v}/stage"
        )
    for method, style in (("sync", "s--"), ("averaging", "^:")):
        ys = [_find(rows, method, m, volunteers=16) for m in names]
        ax.plot(xs, [y["samples_per_s"] if y else None for y in ys], style, label=f"{method}, 16 volunteers")
    ax.set_xticks(list(xs), names)
    ax.set(yscale="log", ylabel="samples/s (emulated)", title="Throughput (missing: over the 512 MiB budget)")
    ax.legend(fontsize=8)


def _plot_bytes(ax: Any, rows: list[Row]) -> None:
    names = _gpts(rows)
    xs = range(len(names))
    for codec in ("fp32", "fp16"):
        ys = [_find(rows, "pipeline", m, stages=4, per_stage=4) for m in names]
        ax.plot(
            xs,
            [y[f"bytes_{codec}"]["activations"] if y else None for y in ys],
            "o-",
            label=f"pipeline S=4 activations+grads ({codec})",
        )
    ys = [_find(rows, "pipeline", m, stages=4, per_stage=4) for m in names]
    ax.plot(
        xs,
        [y["bytes_fp32"]["weights_gradients"] if y else None for y in ys],
        "x-",
        label="pipeline S=4 weights+gradients (4/stage)",
    )
    ax.plot(
        xs, [y["sync_bytes"] if y else None for y in ys], "s--", label="data-parallel sync, 16 volunteers"
    )
    ax.set_xticks(list(xs), names)
    ax.set(yscale="log", ylabel="bytes per sample", title="Bytes on the wire per sample (GPT)")
    ax.legend(fontsize=8)


def _plot_bubble(ax: Any, rows: list[Row]) -> None:
    ms = sorted({r["micro_batches"] for r in rows})
    for s, color in zip(sorted({r["stages"] for r in rows}), ("C0", "C1", "C2"), strict=False):
        formula = [(s - 1) / (m + s - 1) for m in ms]
        ax.plot(ms, formula, "--", color=color, label=f"S={s}: GPipe (S-1)/(M+S-1), band ±10%")
        ax.fill_between(ms, [0.9 * f for f in formula], [1.1 * f for f in formula], color=color, alpha=0.12)
        for family, marker in (("gpt", "o"), ("resnet", "x")):
            pts = [r for r in rows if r["stages"] == s and r["model"].startswith(family)]
            xs, ys = [r["micro_batches"] for r in pts], [r["bubble"] for r in pts]
            ax.plot(xs, ys, marker, color=color, markersize=5, alpha=0.7)
    ax.plot([], [], "ok", markersize=5, label="measured, GPT d_model 32-1024")
    ax.plot([], [], "xk", markersize=5, label="measured, ResNet-18")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="micro-batches M",
        ylabel="idle share",
        title="Bubble, one volunteer per stage, cuts for the shortest step",
    )
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.legend(fontsize=7, loc="lower left")


def _plot_server(ax: Any, rows: list[Row]) -> None:
    pts = [r for r in rows if r["method"] == "pipeline" and r["per_stage"] == 4 and r["stages"] == 4]
    xs = range(len(pts))
    ax.bar([x - 0.2 for x in xs], [r["bytes_fp16"]["server_relay"] for r in pts], 0.4, label="server relay")
    ax.bar([x + 0.2 for x in xs], [r["bytes_fp16"]["server_ring"] for r in pts], 0.4, label="peer ring")
    ax.set_xticks(list(xs), [r["model"] for r in pts])
    ax.set(yscale="log", ylabel="bytes per sample", title="Bytes through the server, S=4, 4/stage, fp16")
    ax.legend(fontsize=8)


def _find(rows: list[Row], method: str, model: str, **where: int) -> Row | None:
    for r in rows:
        if r["method"] == method and r["model"] == model and all(r.get(k) == v for k, v in where.items()):
            return r
    return None
