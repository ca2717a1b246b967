"""Training throughput of the browser graph interpreter vs hand-written TF.js, plus PyTorch CPU.

    .venv/bin/python -m benchmarks.engine.run [--backends webgl,cpu,webgpu] [--models mlp,cnn,...]
        [--webgpu-models mlp,cnn] [--seconds S] [--quick] [--out PATH]

One headless Chromium (SwiftShader WebGL2 and WebGPU, as the browser tests use) loads
benchmarks/engine/index.html and, per backend and model, times training steps (forward + backward +
SGD update, one batch each) of (a) frontend/static/engine (the interpreter) and (b)
benchmarks/engine/handwritten.js on the same weights and batch. Repetitions interleave A B B A A B ...,
so machine noise hits both; each repetition of A and the one of B next to it form a pair, and the ratio
reported is the median over pairs of hand-written ms / interpreter ms (robust to load drifting during a
run on a shared machine). The goal is ratio >= 0.95. Models are the presets and some of
tests/engine/corpus.py; corpus models without a hand-written twin are timed for the interpreter alone
(no ratio). On WebGL the hand-written model is timed twice, under the engine's page-wide setting (unpacked
elementwise kernels, frontend/static/engine/runtime.js guardPackedTextures; the engine packs them in its own
steps where that is safe, runtime.js packedSteps) and under TF.js's defaults, and the faster is the
yardstick. Each row also counts what one step runs (TF.js kernels; on WebGL and WebGPU the
shader programs dispatched, conversions included), which machine load does not move. Writes
benchmarks/results/engine.json.
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
from dataclasses import asdict, dataclass, replace
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from devstack.chromium import CHROMIUM, CHROMIUM_ARGS
from engine.codecs import encode
from engine.export import export_module
from engine.presets import PRESETS, build_preset, export_preset
from tests.engine.corpus import CORPUS

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
RESULTS = ROOT / "benchmarks" / "results" / "engine.json"
GOAL = 0.95


@dataclass(frozen=True)
class Plan:
    batch: int
    warmup: int  # untimed steps first: shader compilation and texture allocation


@dataclass(frozen=True)
class Budget:
    """Per backend and model: the page picks steps per repetition and repetitions to fill budget_ms."""

    budget_ms: int
    min_reps: int
    max_reps: int


# ResNet-18 on SwiftShader takes seconds per step, hence batch 2; it runs only when asked.
PLANS = {
    "mlp": Plan(64, 10),
    "cnn": Plan(32, 2),
    "resnet18": Plan(2, 1),
    "timeseries_cnn": Plan(32, 5),
    "nanogpt": Plan(8, 2),
    "unet": Plan(4, 1),
    "mobilenet_like": Plan(8, 1),
}
BUDGET = Budget(budget_ms=10_000, min_reps=3, max_reps=15)
QUICK = Budget(budget_ms=3_000, min_reps=3, max_reps=5)
DEFAULT_MODELS = "mlp,cnn,timeseries_cnn,nanogpt,unet,mobilenet_like"
HANDWRITTEN = {
    "mlp",
    "cnn",
    "resnet18",
    "timeseries_cnn",
    "nanogpt",
}  # models benchmarks/engine/handwritten.js has
# The hand-written model's timings in bench.js: under the engine's WebGL flags, and (WebGL) under TF.js's own.
HAND_CONFIGS = {"handwritten": "engine flags", "handwritten_tfjs_defaults": "tfjs defaults"}


@dataclass(frozen=True)
class Model:
    """A benchmarked model: the module (for the PyTorch row), its loss and its class count (0: regression)."""

    module: torch.nn.Module
    loss: torch.nn.Module
    classes: int
    input_shape: tuple[int, ...]
    input_dtype: str
    vocab: int = 0


def build_model(name: str) -> Model:
    torch.manual_seed(0)
    if name in PRESETS:
        spec = PRESETS[name]
        return Model(
            build_preset(name), torch.nn.CrossEntropyLoss(), spec.classes, spec.input_shape, "float32"
        )
    c = CORPUS[name]
    return Model(c.build(), c.loss(), c.classes, c.input_shape, c.input_dtype, c.vocab)


def exported(name: str, model: Model) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if name in PRESETS:
        return export_preset(name)
    return export_module(model.module, model.input_shape, model.input_dtype, loss=model.loss, name=name)


# ---- inputs ----------------------------------------------------------------------------------------
def make_batch(model: Model, batch: int, out_shape: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if model.input_dtype == "int64":
        x = torch.randint(0, model.vocab, (batch, *model.input_shape), generator=gen)
    else:
        x = torch.randn((batch, *model.input_shape), generator=gen)
    if model.classes:
        return {"x": x, "y": torch.randint(0, model.classes, (batch,), generator=gen)}
    return {"x": x, "y": torch.randn((batch, *out_shape[1:]), generator=gen)}


def write_blobs(name: str, plan: Plan, directory: Path) -> dict[str, Any]:
    model = build_model(name)
    graph, weights = exported(name, model)
    (directory / f"{name}.graph.json").write_text(json.dumps(graph))
    (directory / f"{name}.weights").write_bytes(encode(weights, "fp32"))
    batch = make_batch(model, plan.batch, graph["targets"][0]["shape"])
    (directory / f"{name}.batch").write_bytes(encode(batch, "fp32"))
    return {
        "graphUrl": f"/blobs/{name}.graph.json",
        "weightsUrl": f"/blobs/{name}.weights",
        "batchUrl": f"/blobs/{name}.batch",
        "classes": model.classes,
        "handwritten": name in HANDWRITTEN,
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
            if not page.evaluate("b => bench.offers(b)", job["backend"]):
                print(f"  {job['backend']:6} not offered by this browser: skipped", file=sys.stderr)
                continue
            started = time.monotonic()
            result = page.evaluate("c => bench.run(c)", job)
            took = time.monotonic() - started
            print(f"  {job['backend']:6} {job['model']:15} done in {took:5.0f} s", file=sys.stderr)
            out.append({**job, **result})
        browser.close()
    return out


def _echo_warnings(message: Any) -> None:
    if message.type in ("warning", "error"):
        print("  [page]", message.text, file=sys.stderr)


# ---- PyTorch reference -----------------------------------------------------------------------------
def torch_ms_per_step(name: str, plan: Plan, reps: int = 5, rep_ms: float = 300) -> list[float]:
    torch.set_num_threads(2)
    model = build_model(name)
    module = model.module.train()
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    out_shape = [plan.batch, *module(make_batch(model, 1, [1])["x"]).shape[1:]]
    batch = make_batch(model, plan.batch, out_shape)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model.loss(module(batch["x"]), batch["y"]).backward()
        opt.step()

    # Steps until rep_ms have passed: a count fixed in advance can run for minutes on a busy machine.
    def rep() -> float:
        t0, n = time.perf_counter(), 0
        while n == 0 or time.perf_counter() - t0 < rep_ms / 1000:
            step()
            n += 1
        return (time.perf_counter() - t0) * 1000 / n

    for _ in range(plan.warmup):
        step()
    return [rep() for _ in range(reps)]


# ---- report ----------------------------------------------------------------------------------------
def summarize(r: dict[str, Any], batch: int) -> dict[str, Any]:
    interp = statistics.median(r["interpreter"])
    row: dict[str, Any] = {
        "backend": r["backend"],
        "model": r["model"],
        "batch": batch,
        "interpreter_ms": interp,
        "handwritten_ms": None,
        "interpreter_sps": batch * 1000 / interp,
        "handwritten_sps": None,
        "ratio": None,
        "logits_rel_diff": r["relDiff"],
        "steps": r["steps"],
        "reps": r["reps"],
        "raw_ms": {"interpreter": r["interpreter"]},
    }
    row["kernels_per_step"] = r.get("kernels")
    twins = [t for t in HAND_CONFIGS if isinstance(r.get(t), list)]
    if twins:
        # The yardstick is the faster configuration of the hand-written model (bench.js withTfjsDefaults).
        yardstick = min(twins, key=lambda t: statistics.median(r[t]))
        hand_times = r[yardstick]
        hand = statistics.median(hand_times)
        pairs = [h / i for h, i in zip(hand_times, r["interpreter"], strict=True)]
        row.update(handwritten_ms=hand, handwritten_sps=batch * 1000 / hand, ratio=statistics.median(pairs))
        row["handwritten_config"] = HAND_CONFIGS[yardstick]
        row["handwritten_ms_by_config"] = {HAND_CONFIGS[t]: statistics.median(r[t]) for t in twins}
        # The fastest repetitions are the least disturbed ones: on a busy machine their ratio is a check.
        best = min(hand_times) / min(r["interpreter"])
        row.update(ratio_of_medians=hand / interp, ratio_of_best=best, ratio_range=[min(pairs), max(pairs)])
        row["raw_ms"].update({t: r[t] for t in twins})
    return row


def table(rows: list[dict[str, Any]], torch_rows: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'backend':8}{'model':16}{'batch':>6}{'interp s/s':>12}{'hand s/s':>11}{'ratio':>8}"
        f"{'pair range':>12}{'best':>8}{'torch-cpu s/s':>15}{'programs i/h':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        hand, ratio, spread, best, mark = "-", "-", "(no twin)", "-", ""
        if r["ratio"] is not None:
            hand, ratio = _sig(r["handwritten_sps"]), f"{r['ratio']:.3f}x"
            spread = f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}"
            best = f"{r['ratio_of_best']:.3f}x"
            mark = "" if r["ratio"] >= GOAL else "  < goal"
        lines.append(
            f"{r['backend']:8}{r['model']:16}{r['batch']:>6}{_sig(r['interpreter_sps']):>12}{hand:>11}{ratio:>8}"
            f"{spread:>12}{best:>8}{_sig(torch_rows[r['model']]['sps']):>15}{_programs(r):>14}{mark}"
        )
    return "\n".join(lines)


def _programs(row: dict[str, Any]) -> str:
    """Shader programs per step, interpreter / hand-written yardstick (GPU backends; "-" elsewhere)."""
    counts = row.get("kernels_per_step") or {}
    interp = (counts.get("interpreter") or {}).get("programs")
    if interp is None:
        return "-"
    twin = {v: k for k, v in HAND_CONFIGS.items()}.get(row.get("handwritten_config") or "")
    hand = (counts.get(twin) or {}).get("programs") if twin else None
    return f"{interp}/{hand}" if hand is not None else str(interp)


def _sig(value: float) -> str:
    """Three significant digits: ResNet-18 on SwiftShader runs well under one sample per second."""
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backends", default="webgl,cpu,webgpu")
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"any of {','.join(PLANS)}")
    # SwiftShader's WebGPU takes seconds per step for the larger models: the presets by default.
    parser.add_argument("--webgpu-models", default="mlp,cnn", help="the subset of --models run on webgpu")
    parser.add_argument("--seconds", type=float, default=0, help="timed seconds per backend and model")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK.budget_ms / 1000:g} s per backend and model"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def plans_for(models: list[str]) -> dict[str, Plan]:
    unknown = set(models) - set(PLANS)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; known: {sorted(PLANS)}")
    return {m: PLANS[m] for m in models}


def budget_for(args: argparse.Namespace) -> Budget:
    budget = QUICK if args.quick else BUDGET
    if not 0 <= args.seconds <= 600:
        raise SystemExit("--seconds must be in 0..600")
    return replace(budget, budget_ms=round(args.seconds * 1000)) if args.seconds else budget


def run_browser(args: argparse.Namespace, plans: dict[str, Plan], budget: Budget) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        blobs = {m: write_blobs(m, plan, Path(tmp)) for m, plan in plans.items()}
        jobs = [
            {"backend": b, "model": m, **blobs[m], "warmup": plans[m].warmup, **_camel(budget)}
            for b in args.backends.split(",")
            if b
            for m in plans
            if b != "webgpu" or m in args.webgpu_models.split(",")
        ]
        with serve(Path(tmp)) as url:
            raw = browser_results(url, jobs)
    return [summarize(r, plans[r["model"]].batch) for r in raw]


def _camel(budget: Budget) -> dict[str, int]:
    return {"budgetMs": budget.budget_ms, "minReps": budget.min_reps, "maxReps": budget.max_reps}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plans, budget = plans_for([m for m in args.models.split(",") if m]), budget_for(args)
    started, load_at_start = time.monotonic(), os.getloadavg()
    rows = run_browser(args, plans, budget)
    torch_rows = {}
    for m, plan in plans.items():
        ms = statistics.median(torch_ms_per_step(m, plan))
        torch_rows[m] = {"model": m, "batch": plan.batch, "ms": ms, "sps": plan.batch * 1000 / ms}
        print(f"  torch  {m:15} {ms:8.1f} ms/step", file=sys.stderr)
    print(table(rows, torch_rows))
    machine = {
        "cpus": os.cpu_count() or 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        # A shared machine's 1-minute load at the start and the end: the times are only as quiet as this.
        "load_average": [round(load_at_start[0], 1), round(os.getloadavg()[0], 1)],
    }
    report = {
        "goal_ratio": GOAL,
        "quick": args.quick,
        "command": " ".join(
            ["python -m benchmarks.engine.run", *(argv if argv is not None else sys.argv[1:])]
        ),
        "seconds": round(time.monotonic() - started),
        "machine": machine,
        "plans": {m: asdict(p) for m, p in plans.items()},
        "budget": asdict(budget),
        "browser": rows,
        "torch_cpu": list(torch_rows.values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['seconds']} s")


if __name__ == "__main__":
    main()
