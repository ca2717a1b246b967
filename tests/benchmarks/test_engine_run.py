"""The engine benchmark's bookkeeping (benchmarks/engine/run.py): paired ratios, plans and budgets refused
when wrong, batches shaped as each model's graph wants, and one short real run in Chromium."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.engine import run


def raw(interp: list[float], hand: list[float] | None) -> dict[str, object]:
    r: dict[str, object] = {
        "backend": "webgl",
        "model": "mlp",
        "relDiff": 0.0,
        "steps": 3,
        "reps": len(interp),
    }
    r["interpreter"] = interp
    if hand is not None:
        r["handwritten"] = hand
    return r


def test_ratio_is_the_median_of_back_to_back_pairs() -> None:
    # Load drifts: the pairs agree (hand-written 10% faster), the medians of each side alone would not.
    row = run.summarize(raw([10.0, 20.0, 40.0], [9.0, 18.0, 36.0]), batch=64)
    assert row["ratio"] == pytest.approx(0.9)
    assert row["ratio_range"] == pytest.approx([0.9, 0.9])
    assert row["ratio_of_best"] == pytest.approx(0.9)
    assert row["interpreter_sps"] == pytest.approx(64 * 1000 / 20.0)


def test_a_model_without_a_hand_written_twin_has_no_ratio() -> None:
    row = run.summarize(raw([5.0, 7.0, 6.0], None), batch=8)
    assert row["ratio"] is None and row["handwritten_ms"] is None
    assert row["interpreter_ms"] == 6.0
    assert "(no twin)" in run.table([row], {"mlp": {"sps": 1.0}})


def test_unknown_models_and_budgets_out_of_range_are_refused() -> None:
    with pytest.raises(SystemExit, match="unknown models"):
        run.plans_for(["mlp", "vgg"])
    for seconds in (-1.0, 601.0):
        with pytest.raises(SystemExit, match="--seconds"):
            run.budget_for(argparse.Namespace(quick=False, seconds=seconds))
    assert run.budget_for(argparse.Namespace(quick=True, seconds=2)).budget_ms == 2000


@pytest.mark.parametrize("name", ["mlp", "timeseries_cnn", "nanogpt", "unet"])
def test_batches_match_the_exported_graph(name: str) -> None:
    model = run.build_model(name)
    graph, _ = run.exported(name, model)
    batch = run.make_batch(model, 3, graph["targets"][0]["shape"])
    assert list(batch["x"].shape[1:]) == graph["inputs"][0]["shape"][1:]
    assert list(batch["y"].shape[1:]) == graph["targets"][0]["shape"][1:]
    assert batch["x"].dtype == (
        run.torch.int64 if graph["inputs"][0]["dtype"] == "int64" else run.torch.float32
    )


@pytest.mark.slow
@pytest.mark.browser
def test_a_short_run_times_both_implementations(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    run.main(["--backends", "cpu", "--models", "timeseries_cnn,unet", "--seconds", "0.5", "--out", str(out)])
    report = run.json.loads(out.read_text())
    rows = {r["model"]: r for r in report["browser"]}
    assert rows["timeseries_cnn"]["ratio"] > 0 and rows["timeseries_cnn"]["logits_rel_diff"] < 1e-5
    assert rows["unet"]["ratio"] is None and rows["unet"]["reps"] >= run.BUDGET.min_reps
    assert {r["model"] for r in report["torch_cpu"]} == {"timeseries_cnn", "unet"}
