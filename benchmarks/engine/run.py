"""Training throughput of the browser graph interpreter vs hand-written TF.js, plus PyTorch CPU.

    .venv/bin/python -m benchmarks.engine.run [--backends webgl,cpu] [--models mlp,cnn,resnet18] [--quick]

One headless Chromium (SwiftShader WebGL2, as the browser tests use) loads benchmarks/engine/index.html
and, per backend and model, times training steps (forward + backward + SGD update, one batch each) of
(a) frontend/static/engine (the interpreter) and (b) benchmarks/engine/handwritten.js on the same
weights and batch, interleaving repetitions so machine noise hits both. Medians are reported; the goal
is interpreter/hand-written >= 0.95. Writes benchmarks/results/engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from devstack.chromium import CHROMIUM, CHROMIUM_ARGS
from engine.codecs import encode
from engine.presets import PRESETS, build_preset, export_preset

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
RESULTS = ROOT / "benchmarks" / "results" / "engine.json"
GOAL = 0.95


@dataclass(frozen=True)
class Plan:
    batch: int
    steps: int  # steps per timed repetition
    reps: int
    warmup: int  # untimed steps first: shader compilation and texture allocation


# ResNet-18 on SwiftShader takes seconds per step, hence batch 2 and few steps.
PLANS = {"mlp": Plan(64, 40, 7, 10), "cnn": Plan(32, 5, 5, 2), "resnet18": Plan(2, 1, 3, 1)}
QUICK = {"mlp": Plan(64, 10, 3, 3), "cnn": Plan(32, 3, 3, 1), "resnet18": Plan(2, 1, 2, 1)}


# ---- inputs ----------------------------------------------------------------------------------------
def make_batch(model: str, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    spec = PRESETS[model]
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn((batch, *spec.input_shape), generator=gen),
        "y": torch.randint(0, spec.classes, (batch,), generator=gen),
    }


def write_blobs(model: str, plan: Plan, directory: Path) -> dict[str, str]:
    graph, weights = export_preset(model)
    (directory / f"{model}.graph.json").write_text(json.dumps(graph))
    (directory / f"{model}.weights").write_bytes(encode(weights, "fp32"))
    (directory / f"{model}.batch").write_bytes(encode(make_batch(model, plan.batch), "fp32"))
    return {
        "graphUrl": f"/blobs/{model}.graph.json",
        "weightsUrl": f"/blobs/{model}.weights",
        "batchUrl": f"/blobs/{model}.batch",
    }


# ---- static server (the URL layout of tests/browser/conftest.py, plus /bench/) --------------------
def _handler(blob_dir: Path) -> type[SimpleHTTPRequestHandler]:
    routes = (
        ("/static/vendor/", ROOT / "frontend" / "vendor"),
        ("/static/", ROOT / "frontend" / "static"),
        ("/bench/", BENCH),
        ("/blobs/", blob_dir),
    )

    class Handler(SimpleHTTPRequestHandler):
        def translate_path(self, path: str) -> str:
            path = path.split("?", 1)[0]
            for prefix, base in routes:
                rel = Path(path[len(prefix) :])
                if path.startswith(prefix) and ".." not in rel.parts:
                    return str(base / rel)
            return str(BENCH / "__missing__")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            pass

    return Handler


@contextmanager
def serve(blob_dir: Path) -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(blob_dir))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---- browser runs ----------------------------------------------------------------------------------
def browser_results(url: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS), headless=True)
        page = browser.new_page()
        page.on("console", _echo_warnings)
        page.goto(f"{url}/bench/index.html")
        page.wait_for_function("() => self.bench && self.handwritten && self.crowdtrain.optim")
        for job in jobs:
            started = time.monotonic()
            result = page.evaluate("c => bench.run(c)", job)
            print(
                f"  {job['backend']:5} {job['model']:8} done in {time.monotonic() - started:5.0f} s",
                file=sys.stderr,
            )
            out.append({**job, **result})
        browser.close()
    return out


def _echo_warnings(message: Any) -> None:
    if message.type in ("warning", "error"):
        print("  [page]", message.text, file=sys.stderr)


# ---- PyTorch reference -----------------------------------------------------------------------------
def torch_ms_per_step(model: str, plan: Plan) -> list[float]:
    torch.set_num_threads(2)
    module = build_preset(model).train()
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    batch = make_batch(model, plan.batch)

    def steps(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(module(batch["x"]), batch["y"]).backward()
            opt.step()
        return (time.perf_counter() - t0) * 1000 / n

    steps(plan.warmup)
    # Cheap here, so time more steps per repetition than the browser does.
    return [steps(plan.steps * 5) for _ in range(plan.reps)]


# ---- report ----------------------------------------------------------------------------------------
def summarize(r: dict[str, Any], batch: int) -> dict[str, Any]:
    interp, hand = statistics.median(r["interpreter"]), statistics.median(r["handwritten"])
    return {
        "backend": r["backend"],
        "model": r["model"],
        "batch": batch,
        "interpreter_ms": interp,
        "handwritten_ms": hand,
        "interpreter_sps": batch * 1000 / interp,
        "handwritten_sps": batch * 1000 / hand,
        "ratio": hand / interp,
        "logits_rel_diff": r["relDiff"],
        "raw_ms": {"interpreter": r["interpreter"], "handwritten": r["handwritten"]},
    }


def table(rows: list[dict[str, Any]], torch_rows: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'backend':8}{'model':10}{'batch':>6}{'interp s/s':>12}{'hand s/s':>12}{'ratio':>8}  "
        f"{'torch-cpu s/s':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "" if r["ratio"] >= GOAL else "  < goal"
        lines.append(
            f"{r['backend']:8}{r['model']:10}{r['batch']:>6}{_sig(r['interpreter_sps']):>12}"
            f"{_sig(r['handwritten_sps']):>12}{r['ratio']:>7.3f}x  "
            f"{_sig(torch_rows[r['model']]['sps']):>14}{mark}"
        )
    return "\n".join(lines)


def _sig(value: float) -> str:
    """Three significant digits: ResNet-18 on SwiftShader runs well under one sample per second."""
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backends", default="webgl,cpu")
    parser.add_argument("--models", default="mlp,cnn,resnet18")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plans = QUICK if args.quick else PLANS
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(plans)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; known: {sorted(plans)}")
    with tempfile.TemporaryDirectory() as tmp:
        urls = {m: write_blobs(m, plans[m], Path(tmp)) for m in models}
        jobs = [
            {"backend": b, "model": m, **urls[m], **asdict(plans[m])}
            for b in args.backends.split(",")
            if b
            for m in models
        ]
        with serve(Path(tmp)) as url:
            raw = browser_results(url, jobs)
    rows = [summarize(r, plans[r["model"]].batch) for r in raw]
    torch_rows = {}
    for m in models:
        ms = statistics.median(torch_ms_per_step(m, plans[m]))
        torch_rows[m] = {"model": m, "batch": plans[m].batch, "ms": ms, "sps": plans[m].batch * 1000 / ms}
    print(table(rows, torch_rows))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count() or 0, "python": platform.python_version(), "torch": torch.__version__}
    RESULTS.write_text(
        json.dumps(
            {
                "goal_ratio": GOAL,
                "quick": args.quick,
                "machine": machine,
                "plans": {m: asdict(plans[m]) for m in models},
                "browser": rows,
                "torch_cpu": list(torch_rows.values()),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
