"""The scaling benchmark's heterogeneous fleet (benchmarks/scaling/fleet.py): speeds 10x apart, a churn
schedule that is deterministic and at the stated rate, and busy fractions as defined."""

from __future__ import annotations

import os
import statistics
import threading

import pytest
import torch

from benchmarks.scaling import fleet
from benchmarks.scaling.config import Options
from benchmarks.scaling.emulation import Emulation, device_pool, device_processes, heterogeneous_top_gflops
from benchmarks.scaling.run import parser
from benchmarks.scaling.runner import baseline
from engine.graph import load_graph
from engine.presets import export_preset
from workers.simulator import Unit, honest_update


@pytest.mark.parametrize("n", [32, 64])
def test_speeds_spread_ten_times_log_uniformly(n: int) -> None:
    speeds = fleet.speeds(n, top=1.0)
    assert len(speeds) == n and speeds == sorted(speeds, reverse=True)
    assert 9.0 < speeds[0] / speeds[-1] < 10.0
    assert all(0.1 < s < 1.0 for s in speeds)
    # evenly spaced in log: a constant ratio between neighbours
    ratios = {round(a / b, 3) for a, b in zip(speeds, speeds[1:], strict=False)}
    assert len(ratios) <= 2  # rounding
    assert statistics.fmean(speeds) == pytest.approx(0.9 / 2.302585, rel=0.02)  # (1 - 0.1) / ln 10


def test_speeds_scale_together() -> None:
    assert fleet.speeds(64, top=0.5) == pytest.approx([s / 2 for s in fleet.speeds(64, top=1.0)], abs=2e-6)


def test_churn_is_deterministic_and_at_the_stated_rate() -> None:
    hour = fleet.churn(64, rate_per_hour=0.2, horizon_s=3600.0, seed=64)
    assert hour == fleet.churn(64, rate_per_hour=0.2, horizon_s=3600.0, seed=64)
    assert len(hour) == round(0.2 * 64)  # 12.8 -> every 281 s from 140 s: 13 in the hour
    interval = 3600 / (0.2 * 64)
    assert [d.at_s for d in hour] == pytest.approx([interval * (k + 0.5) for k in range(len(hour))], abs=0.01)
    assert all(d.rejoin_at_s == pytest.approx(d.at_s + fleet.REJOIN_SECONDS) for d in hour)
    assert {d.slot for d in hour} <= set(range(64))
    assert fleet.churn(64, rate_per_hour=0.2, horizon_s=3600.0, seed=1) != hour


def test_a_slot_is_not_drawn_again_before_its_replacement_joined() -> None:
    departures = fleet.churn(2, rate_per_hour=200.0, horizon_s=60.0, seed=0)  # one every 9 s, away 30 s
    for d in departures:
        away = [e for e in departures if e.at_s < d.at_s < e.rejoin_at_s]
        assert d.slot not in {e.slot for e in away}
    assert len({d.slot for d in departures[:2]}) == 2


def test_no_churn_without_a_rate() -> None:
    assert fleet.churn(64, rate_per_hour=0.0, horizon_s=3600.0) == []


def test_busy_fraction_counts_computing_time_from_the_first_unit_to_the_end() -> None:
    # computes 0-8 and 10-18 (then cut off at 19 by the end): 16 busy of 19
    assert fleet.busy_fraction([(0.0, 8.0), (10.0, 18.0)], end=19.0) == pytest.approx(16 / 19)
    # a unit still running at the end counts up to the end only; the wait before the first unit never
    assert fleet.busy_fraction([(5.0, 9.0), (10.0, 30.0)], end=15.0) == pytest.approx(9 / 10)
    assert fleet.busy_fraction([(20.0, 30.0)], end=15.0) is None
    # a unit cancelled mid-way (the round closed) stopped when the next one started
    assert fleet.busy_fraction([(0.0, 40.0), (10.0, 20.0)], end=20.0) == pytest.approx(1.0)
    assert fleet.busy_fraction([(10.0, 20.0), (0.0, 40.0)], end=30.0) == pytest.approx(20 / 30)


def test_busy_fraction_at_steady_state_counts_from_a_moment_on() -> None:
    """`since`: the first round planned for the whole fleet (runner.busy); before it, volunteers still
    signing in get what is left of a round planned for fewer, and wait for the next."""
    intervals = [(0.0, 8.0), (40.0, 79.0), (80.0, 119.0)]
    assert fleet.busy_fraction(intervals, end=120.0) == pytest.approx(86 / 120)
    assert fleet.busy_fraction(intervals, end=120.0, since=40.0) == pytest.approx(78 / 80)
    assert fleet.busy_fraction(intervals, end=120.0, since=50.0) == pytest.approx(68 / 70)
    assert fleet.busy_fraction([(90.0, 119.0)], end=120.0, since=40.0) == pytest.approx(29 / 30)  # joined
    assert fleet.busy_fraction([(0.0, 8.0)], end=120.0, since=40.0) is None  # left before it


def test_busy_summary_is_the_median_and_tenth_percentile() -> None:
    summary = fleet.busy_summary([i / 100 for i in range(1, 101)])
    assert summary["busy_median"] == pytest.approx(0.505)
    assert summary["busy_p10"] == pytest.approx(0.109)
    assert summary["devices"] == 100 and summary["busy_min"] == 0.01


def test_the_top_speed_fills_a_shard_in_target_seconds_unless_the_machine_cannot_afford_it() -> None:
    calibration = {
        "flops_per_sample": 409088.0,
        "gradient_64_gflops_total": 100.0,
        "local_steps_3000_gflops_total": 100.0,
    }
    assert heterogeneous_top_gflops(calibration, 64) == pytest.approx(6000 * 409088 / 40e9, rel=0.01)
    calibration.update(gradient_64_gflops_total=2.0)
    slow = heterogeneous_top_gflops(calibration, 64)
    assert sum(fleet.speeds(64, slow)) == pytest.approx(2.0 / 4, rel=0.01)


def test_the_baseline_is_one_mean_volunteer_computing_the_aggregated_samples_back_to_back() -> None:
    row = {
        "reached": True,
        "samples_aggregated_to_target": 1_000_000,
        "seconds_to_target": 100.0,
        "volunteers": 64,
    }
    # 1e6 samples x 4e5 FLOPs at 0.02 GFLOP/s = 20,000 s alone, 200x the fleet's 100 s
    assert baseline(row, mean_gflops=0.02, flops_per_sample=4e5) == {
        "one_mean_volunteer_seconds": 20000.0,
        "speedup": 200.0,
        "efficiency": 3.125,
    }
    assert baseline({**row, "reached": False}, 0.02, 4e5)["speedup"] is None


def test_emulated_devices_compute_at_the_lowest_priority_by_default() -> None:
    """The volunteers' threads yield the CPU to the server under test (emulation.device_pool); this thread,
    which runs their protocol and the run, keeps its own. `--device-nice 0` measures without it."""
    assert Emulation(gflops=1.0, timeout=1.0, calibration={}).device_nice == Options.device_nice == 19
    assert parser().parse_args([]).device_nice == 19
    assert parser().parse_args(["--device-nice", "0"]).device_nice == 0
    own = _nice()
    with device_pool(2, nice=19) as pool:
        niceness = set(pool.map(lambda _: _nice(), range(8)))
    assert niceness == {19} and own < 19
    assert _nice() == own


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_emulated_devices_train_in_processes_of_their_own_with_the_same_numbers() -> None:
    """Off the harness's GIL (emulation.device_processes), at the lowest priority, and the update is the
    one the same unit gives in this process; `--device-processes 0` trains in threads as before."""
    assert Emulation(gflops=1.0, timeout=1.0, calibration={}).device_processes == Options.device_processes > 0
    assert parser().parse_args(["--device-processes", "0"]).device_processes == 0
    exported, weights = export_preset("mlp")
    graph = load_graph(exported)
    x, y = torch.rand(12, 1, 28, 28), torch.randint(0, 10, (12,))
    unit = Unit(1, 1, 0, "local_steps", "/g", "/w", [], batch_size=4, lr=0.1, momentum=0.9, codec="fp32")
    with device_processes(2, nice=19) as pool:
        remote = pool.submit(honest_update, graph, weights, x, y, unit).result()
        pids = set(pool.map(_pid_nice, range(4)))
    here = honest_update(graph, weights, x, y, unit)
    # One torch thread there: sums may round in another order (the loss once differed in its 8th digit).
    assert remote[1] == pytest.approx(here[1], rel=1e-6) and remote[0].keys() == here[0].keys()
    for name, value in here[0].items():
        torch.testing.assert_close(remote[0][name], value, rtol=0, atol=1e-6)
    assert {nice for _, nice in pids} == {19} and os.getpid() not in {pid for pid, _ in pids}


def test_emulated_volunteers_ask_for_their_next_unit_as_browsers_do() -> None:
    """contribute.js asks for the next unit as soon as it gets one; `--no-prefetch` measures without it."""
    assert Emulation(gflops=1.0, timeout=1.0, calibration={}).prefetch and Options.prefetch
    assert parser().parse_args([]).prefetch and not parser().parse_args(["--no-prefetch"]).prefetch


def _pid_nice(_: int) -> tuple[int, int]:
    return os.getpid(), os.getpriority(os.PRIO_PROCESS, 0)
