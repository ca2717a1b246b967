"""The pipeline benchmark's bookkeeping (benchmarks/pipeline): the bubble it reports is the timetable's and
equals GPipe's formula for equal stages, bytes through the server with the ring are only what decides
credit plus digests and signalling, and the verdict compares the widest GPT that fits one device."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.pipeline import emulation as emu
from benchmarks.pipeline import run
from benchmarks.pipeline.config import HASH_MESSAGE_BYTES, MICRO_BATCH, SIGNAL_BYTES_PER_LINK
from benchmarks.pipeline.models import ModelFacts, StageFacts
from engine.schedule import gpipe_bubble


def stage(work: float, last: bool = False, grad_back: bool = True) -> StageFacts:
    """A stage whose forward unit takes ``work`` / 4 and backward unit the rest (last: one unit);
    ``grad_back``: it sends the gradient of its input back (something before it trains)."""
    return StageFacts(work / 4, 3 * work / 4, 1000, 0 if last else 256, grad_back)


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (4, 16), (8, 32)])
def test_equal_stages_measure_gpipes_bubble(stages: int, micro_batches: int) -> None:
    facts = [stage(1e9) for _ in range(stages - 1)] + [stage(1e9, last=True)]
    b = emu.measured_bubble(facts, micro_batches)
    assert b.idle == pytest.approx(gpipe_bubble(stages, micro_batches), abs=1e-12) == b.formula
    assert b.balance == pytest.approx(1.0)


def test_a_light_first_stage_idles_more_than_gpipes_share() -> None:
    facts = [stage(0.6e9), stage(1e9), stage(1e9), stage(1e9, last=True)]
    b = emu.measured_bubble(facts, 16)
    assert b.idle > 1.2 * b.formula and b.balance == pytest.approx(1e9 / 0.9e9)


def test_with_the_ring_the_server_sees_data_weights_gradients_digests_and_signals() -> None:
    facts = [stage(1e9), stage(1e9, grad_back=False), stage(1e9, last=True)]  # stage 0 trains nothing
    groups = [[1.0, 1.0], [1.0, 1.0, 1.0], [1.0]]
    t = emu.pipeline_traffic(facts, groups, 2.0, data_bytes=100)
    crossing = 256 * 2 / 4  # fp16: half the fp32 bytes per sample
    assert t.activations == crossing * 2 + crossing  # both boundaries forward; back across the second only
    assert t.digests == 3 * HASH_MESSAGE_BYTES / MICRO_BATCH
    assert t.signalling == (2 * 3 + 3 * 1) * SIGNAL_BYTES_PER_LINK / emu.BATCH
    assert t.server_ring == 100 + t.weights + t.digests + t.signalling
    assert t.server_relay == 100 + t.weights + 2 * t.activations


def facts(name: str, params: int, fits: bool) -> ModelFacts:
    return ModelFacts(name, params, 1, 1, fits, 1)


def test_the_verdict_takes_the_widest_gpt_that_fits_one_device() -> None:
    built: list[tuple[Any, ModelFacts, run.Splits]] = [
        (None, facts("gpt-256", 10, True), {}),
        (None, facts("gpt-512", 40, True), {}),
        (None, facts("gpt-1024", 160, False), {}),
        (None, facts("resnet18", 80, True), {}),
    ]
    rows = [
        {
            "method": "pipeline",
            "model": "gpt-512",
            "stages": 4,
            "per_stage": v,
            "samples_per_s": 9.0,
            "sync_samples_per_s": sync,
        }
        for v, sync in ((1, 3.0), (4, 10.0))
    ]
    bubbles = [
        {"model": "gpt-512", "stages": s, "micro_batches": m, "over_10pct": s == 2}
        for s in (2, 4)
        for m in (4, 16)
    ]
    v = run.verdict(built, rows, bubbles)
    assert v["widest_fitting_one_device"] == "gpt-512"
    assert not v["pipeline_beats_sync_everywhere"]
    assert v["bubble_at_most_10pct_over"] == [("gpt-512", 4)]
    assert v["bubble_more_than_10pct_over"] == [("gpt-512", 2)]
