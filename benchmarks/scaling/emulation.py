"""The emulated volunteers: how fast a device is (calibrated on this machine) and what each one did.

Each volunteer computes its update for real but does not answer before samples x FLOPs-per-sample / gflops
(workers/simulator.py's emulation); its `on_compute` hook records both times, so that every work unit whose
real compute took longer than its emulated time can be counted and flagged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.numpy import load as load_shard

from engine.flops import train_flops_per_sample
from engine.graph import Graph, load_graph
from engine.runtime import compute_gradients, local_steps
from workers import simulator
from workers.simulator import Simulator, SimulatorConfig, Unit

from . import fleet
from .config import (
    DEVICE_NICE,
    DEVICE_PROCESSES,
    LOCAL_MINIBATCH,
    SHARD_SAMPLES,
    TARGET_SECONDS,
    UNITS_PER_ROUND,
)

Tensors = dict[str, torch.Tensor]


# --- device speed ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Emulation:
    gflops: float  # per volunteer
    timeout: float  # seconds per run before giving up
    calibration: dict[str, float]
    device_nice: int = DEVICE_NICE  # the CPU priority of the volunteers' threads (device_pool)
    device_processes: int = DEVICE_PROCESSES  # where they train; 0: device_pool's threads
    prefetch: bool = True  # each asks for its next unit as soon as it gets one, as browsers do


def emulated_gflops(capacity: float) -> float:
    """Per volunteer: UNITS_PER_ROUND of them use half of the machine's measured `capacity`, 2 digits."""
    return float(f"{capacity / (2 * UNITS_PER_ROUND):.2g}")


def capacity(calibration: dict[str, float]) -> float:
    """The machine's real throughput for the slower of the two kinds of work unit."""
    return min(calibration["gradient_64_gflops_total"], calibration["local_steps_3000_gflops_total"])


def heterogeneous_top_gflops(calibration: dict[str, float], volunteers: int) -> float:
    """The fastest device of a heterogeneous fleet (fleet.speeds) of `volunteers`, 2 digits: the speed whose
    TARGET_SECONDS unit fills a shard (the cap of a unit's size while units could not span two shards, kept
    so that runs stay comparable with earlier ones), unless the whole fleet would then emulate more than a
    quarter of the machine's measured capacity (not the homogeneous runs' half: every result of a volunteer
    not trusted yet is recomputed on the server, and many threads share the cores)."""
    fills = SHARD_SAMPLES * calibration["flops_per_sample"] / (TARGET_SECONDS * 1e9)
    affordable = capacity(calibration) / (4 * sum(fleet.speeds(volunteers, 1.0)))
    return float(f"{min(fills, affordable):.2g}")


def emulation(
    calibration: dict[str, float],
    gflops: float | None,
    timeout: float | None,
    quick: bool,
    heterogeneous_at: int = 0,
) -> Emulation:
    """The device speed (the top speed of a heterogeneous fleet of `heterogeneous_at`) and run timeout: as
    given, or from the calibration."""
    if heterogeneous_at:
        top = gflops or heterogeneous_top_gflops(calibration, heterogeneous_at)
        return Emulation(top, timeout or 900.0, calibration)
    gflops = gflops or emulated_gflops(capacity(calibration))
    # The runs' length scales with the emulated device time (600 s was plenty at 0.5 GFLOP/s).
    timeout = timeout or (240.0 if quick else 600.0) * max(1.0, 0.5 / gflops)
    return Emulation(gflops, timeout, calibration)


def _mlp_graph() -> tuple[Graph, Tensors]:
    from engine.presets import export_preset

    graph, weights = export_preset("mlp")
    return load_graph(json.dumps(graph).encode()), weights


def calibrate(concurrency: int, seconds: float = 4.0) -> dict[str, float]:
    """Real throughput (server FLOP count) of `concurrency` volunteers computing at once, as the
    simulator does it (threads in one process): for a 64-sample gradient and a 3,000-sample local pass."""
    graph, weights = _mlp_graph()
    fps = train_flops_per_sample(graph)
    x, y = torch.rand(3000, 1, 28, 28), torch.randint(0, 10, (3000,))
    inp, tgt = graph.inputs[0].name, graph.targets[0].name

    def gradient() -> int:
        compute_gradients(graph, weights, {inp: x[:64]}, {tgt: y[:64]})
        return 64

    def local() -> int:
        local_steps(graph, weights, {inp: x}, {tgt: y}, batch_size=LOCAL_MINIBATCH, lr=0.05, momentum=0.9)
        return 3000

    out: dict[str, float] = {
        "flops_per_sample": fps,
        "concurrency": concurrency,
        "load_average_1m": os.getloadavg()[0],
    }
    for name, fn in (("gradient_64", gradient), ("local_steps_3000", local)):
        samples_per_second = _throughput(fn, concurrency, seconds)
        out[f"{name}_gflops_total"] = round(samples_per_second * fps / 1e9, 2)
    return out


def _throughput(fn: Callable[[], int], concurrency: int, seconds: float) -> float:
    """Samples per second of `fn` (returning its samples) run in `concurrency` threads for `seconds`."""
    stop = time.monotonic() + seconds

    def loop(_: int) -> int:
        done = 0
        while time.monotonic() < stop:
            done += fn()
        return done

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        samples = sum(pool.map(loop, range(concurrency)))
    return samples / (time.monotonic() - started)


def warm_up(graph: Graph, x: torch.Tensor, y: torch.Tensor) -> None:
    """One untimed gradient and local pass in this process (first calls pay for allocator/thread pool set-up,
    which a browser pays once too), so the first work unit is not mistaken for slow emulation."""
    gen = torch.Generator().manual_seed(0)
    weights = {p.name: torch.randn(tuple(p.shape), generator=gen) * 0.01 for p in graph.params}
    inp, tgt = {graph.inputs[0].name: x[:256]}, {graph.targets[0].name: y[:256]}
    compute_gradients(graph, weights, inp, tgt)
    local_steps(graph, weights, inp, tgt, batch_size=64, lr=0.01, momentum=0.9)


# --- the volunteers' own CPU -------------------------------------------------------------------------


def device_pool(workers: int, *, nice: int) -> concurrent.futures.ThreadPoolExecutor:
    """The threads the emulated volunteers compute in (the run's default executor), at CPU priority `nice`
    (Emulation.device_nice: by default 19, the lowest; `--device-nice 0` measures without it). Real
    volunteers compute on their own hardware; here they share the server's two cores, and at a round's start
    64 of them computing at once took the CPU from the server handing out that round's work, so the last
    devices started seconds late and the benchmark charged the platform for its own harness (README, the
    heterogeneous runs). A device still answers no sooner than its emulated time, which its real compute
    stays well inside (`compute_real_over_emulated` counts the units that did not)."""
    return concurrent.futures.ThreadPoolExecutor(workers, initializer=_yield_cpu, initargs=(nice,))


def _yield_cpu(nice: int) -> None:
    # Linux sets a nice value per thread: PRIO_PROCESS with a thread's id changes that thread alone.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def device_processes(workers: int, *, nice: int) -> concurrent.futures.ProcessPoolExecutor:
    """Processes the emulated volunteers train in (Simulator.compute), at CPU priority `nice`, started
    before the clock. In device_pool's threads, training held the harness's GIL between torch calls, and a
    thread at nice 19 holding it could be preempted by the server under test, leaving the event loop and the
    other volunteers' downloads waiting: at a round's start, a 104 KB weights delta took 0.5-2.3 s to arrive
    for the volunteers assigned after the first batch, against 20-100 ms for the first, and in processes the
    devices' start p90 halved (README, "The harness's own GIL"). A browser trains in a Web Worker of its own
    and downloads beside it."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "workers.simulator"])
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_device_process, initargs=(nice,)
    )
    for started in [pool.submit(time.sleep, 0.5) for _ in range(workers)]:
        started.result()
    return pool


def _device_process(nice: int) -> None:
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    torch.set_num_threads(1)  # the processes share the machine's cores with the server: one each


# --- the shards, parsed once for all volunteers


_parsed: dict[int, tuple[bytes, dict[str, Any]]] = {}


def shared_shard(data: bytes) -> dict[str, Any]:
    """safetensors' load, once per shard for the whole process: the emulated volunteers share one event loop,
    where parsing a 6,000-image shard for every unit (19 MB copied, 10-20 ms) delayed the last of 64
    volunteers' starts by a second that a browser, decoding in its own worker, does not spend. Shards are
    immutable and every volunteer holds the same pre-cached bytes object, which keys the cache."""
    hit = _parsed.get(id(data))
    if hit is None or hit[0] is not data:
        hit = (data, load_shard(data))
        _parsed[id(data)] = hit
    return hit[1]


def share_parsed_shards() -> None:
    simulator.load_shard = shared_shard


# --- what each volunteer did -------------------------------------------------------------------------


@dataclass
class UnitTiming:
    samples: int
    real_s: float  # wall time of the real computation (thread queue included), as the simulator measures it
    emulated_s: float


@dataclass
class Tally:
    weights_bytes: int = 0
    graph_bytes: int = 0
    units: list[UnitTiming] = field(default_factory=list)
    # (start, stop) on the monotonic clock of each unit's emulated computation: the device's busy time
    computing: list[tuple[float, float]] = field(default_factory=list)


class CountingSimulator(Simulator):
    """The simulator, with its downloads sorted by kind (weights vs graph) for the byte accounting and
    the real and emulated time of every work unit it computed."""

    def __init__(
        self, config: SimulatorConfig, graph_url: str, compute: concurrent.futures.Executor | None = None
    ) -> None:
        super().__init__(config, on_compute=self._computed, compute=compute)
        self.tally, self.graph_url = Tally(), graph_url
        self.left_at: float | None = None  # when it left the run (churn), on the monotonic clock
        self.watches: set[asyncio.Task[None]] = set()  # _cut tasks

    def _computed(self, unit: Unit, real_s: float, emulated_s: float) -> None:
        """Called (in the event loop) as the real computation ends; the device computes until its emulated
        time is up, or until the server cancels the unit (its round closed)."""
        self.tally.units.append(UnitTiming(unit.samples, real_s, emulated_s))
        started = time.monotonic() - real_s
        self.tally.computing.append((started, started + max(real_s, emulated_s)))
        if self.session is not None:
            cancel = self.session.cancelled.setdefault(unit.id, asyncio.Event())
            watch = asyncio.get_running_loop().create_task(self._cut(cancel, len(self.tally.computing) - 1))
            self.watches.add(watch)
            watch.add_done_callback(self.watches.discard)

    async def _cut(self, cancel: asyncio.Event, index: int) -> None:
        """End the unit's computing time when it is cancelled before its emulated time is up."""
        start, stop = self.tally.computing[index]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cancel.wait(), max(0.0, stop - time.monotonic()))
            self.tally.computing[index] = (start, min(stop, time.monotonic()))

    async def download(self, url: str) -> bytes:
        cached = self.cache.get(url) is not None
        data = await super().download(url)
        if not cached:
            if url.endswith(self.graph_url):
                self.tally.graph_bytes += len(data)
            else:
                self.tally.weights_bytes += len(data)
        return data


def totals(sims: list[CountingSimulator]) -> dict[str, int]:
    """Traffic and work of all volunteers so far."""
    return {
        "bytes_sent": sum(s.stats.bytes_sent for s in sims),
        "bytes_received": sum(s.stats.bytes_received for s in sims),
        "weights_bytes": sum(s.tally.weights_bytes for s in sims),
        "graph_bytes": sum(s.tally.graph_bytes for s in sims),
        "work_units": sum(s.stats.work_units for s in sims),
        "samples_computed": sum(u.samples for s in sims for u in s.tally.units),
    }


def unit_timings(sims: list[CountingSimulator]) -> dict[str, Any]:
    """How the real compute compared with the emulated device time, over every work unit."""
    units = [u for s in sims for u in s.tally.units]
    return {
        "work_units_all": len(units),
        "compute_real_over_emulated": sum(1 for u in units if u.real_s > u.emulated_s),
        "compute_real_over_emulated_max_ratio": round(
            max((u.real_s / u.emulated_s for u in units), default=0.0), 3
        ),
        "compute_real_median_s": _median([u.real_s for u in units]),
        "compute_emulated_median_s": _median([u.emulated_s for u in units]),
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None
