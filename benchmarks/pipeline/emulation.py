"""Emulated time: compute from FLOPs at stated volunteer speeds, transfers from bytes over stated links.

Nothing is trained here: the graphs and partitions are real (engine/partition.py), the timetable is the
engine's (engine/schedule.py), and time is what those FLOPs and bytes cost at config.py's speeds.
Links are not contended (a volunteer sending two activations at once sends each at full speed).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.schedule import (
    BACKWARD,
    StageTimes,
    Unit,
    dependencies,
    gpipe_bubble,
    gpipe_timetable,
    units,
)

from .config import (
    CHURN_PER_MIN,
    DETECT_S,
    DEVICES,
    HASH_MESSAGE_BYTES,
    JOIN_DELAY_S,
    LOCAL_STEPS,
    MICRO_BATCH,
    MICRO_BATCHES,
    SIGNAL_BYTES_PER_LINK,
    link_time,
)
from .models import ModelFacts, StageFacts

BATCH = MICRO_BATCH * MICRO_BATCHES  # samples per step


def draw_speeds(count: int, rng: random.Random) -> list[float]:
    """FLOP/s of ``count`` volunteers drawn from the device mix."""
    kinds = list(DEVICES.values())
    return [rng.choices([s for s, _ in kinds], [w for _, w in kinds])[0] * 1e9 for _ in range(count)]


def stage_work(stage: StageFacts) -> float:
    return stage.forward + stage.backward


def assign(stages: Sequence[StageFacts], speeds: Sequence[float], per_stage: int) -> list[list[float]]:
    """Fastest volunteers first, each to the stage (with room) that is the bottleneck so far."""
    groups: list[list[float]] = [[] for _ in stages]
    for speed in sorted(speeds, reverse=True):
        open_ = [k for k in range(len(stages)) if len(groups[k]) < per_stage]
        k = max(open_, key=lambda k: stage_work(stages[k]) / max(sum(groups[k]), 1e-9))
        groups[k].append(speed)
    return groups


def times(stages: Sequence[StageFacts]) -> list[StageTimes]:
    return [StageTimes(s.forward, s.backward) for s in stages]


def crossing_bytes(stage: StageFacts, codec_bytes: float) -> float:
    """One micro-batch's activation leaving ``stage`` under a codec of ``codec_bytes`` per element."""
    return stage.crossing * MICRO_BATCH * codec_bytes / 4


def transfers(stages: Sequence[StageFacts], codec_bytes: float, relay: bool) -> list[float]:
    hops = 2 if relay else 1  # through the server: up to it, then down to the next stage
    return [hops * link_time(crossing_bytes(s, codec_bytes)) for s in stages[:-1]]


# ---------------------------------------------------------------- one step, no churn


@dataclass(frozen=True)
class PipelineRun:
    samples_per_s: float
    step_s: float
    makespan_s: float
    bubble: float  # idle share of every volunteer's time within the timetable


def pipeline_run(
    stages: Sequence[StageFacts], groups: Sequence[Sequence[float]], codec_bytes: float, relay: bool
) -> PipelineRun:
    t = gpipe_timetable(
        times(stages), MICRO_BATCHES, speeds=groups, transfer=transfers(stages, codec_bytes, relay)
    )
    sync = 2 * link_time(max(s.param_bytes for s in stages))  # stage weights down, summed gradients up
    step = sync + t.makespan
    return PipelineRun(BATCH / step, step, t.makespan, t.bubble)


@dataclass(frozen=True)
class Bubble:
    idle: float  # idle share of the stages' time (fill, drain and imbalance)
    fill_drain: float  # 1 - M x (slowest stage's time per micro-batch) / makespan: imbalance left out
    formula: float  # GPipe's (S-1)/(M+S-1)
    makespan: float  # FLOPs (one volunteer of speed 1 per stage)
    balance: float  # the slowest stage's work over the mean


def measured_bubble(stages: Sequence[StageFacts], micro_batches: int = MICRO_BATCHES) -> Bubble:
    """One volunteer per stage, all of one speed, no transfer time: the schedule alone."""
    t = gpipe_timetable(times(stages), micro_batches)
    work = [stage_work(s) for s in stages]
    return Bubble(
        t.bubble,
        1 - micro_batches * max(work) / t.makespan,
        gpipe_bubble(len(stages), micro_batches),
        t.makespan,
        max(work) * len(work) / sum(work),
    )


# ---------------------------------------------------------------- bytes


@dataclass(frozen=True)
class Traffic:
    """Bytes per sample. Through the server with the ring: the data, the stage weights down and the summed
    gradients up (the results that decide credit), a digest per activation or gradient sent peer to peer,
    and the links' signalling; with the relay, every activation and gradient instead, up and down."""

    activations: float  # on the wire, peer to peer
    weights: float  # weights down and gradients up
    digests: float
    signalling: float
    data: float

    @property
    def server_relay(self) -> float:
        return self.data + self.weights + 2 * self.activations

    @property
    def server_ring(self) -> float:
        return self.data + self.weights + self.digests + self.signalling


def pipeline_traffic(
    stages: Sequence[StageFacts], groups: Sequence[Sequence[float]], codec_bytes: float, data_bytes: int
) -> Traffic:
    crossing = [crossing_bytes(s, codec_bytes) / MICRO_BATCH for s in stages[:-1]]
    back = [crossing[k] if stages[k + 1].sends_grad_back else 0.0 for k in range(len(crossing))]
    weights = sum(len(g) * 2 * s.param_bytes for s, g in zip(stages, groups, strict=True)) / BATCH
    sent = len(crossing) + sum(1 for b in back if b)  # messages per micro-batch
    links = sum(len(a) * len(b) for a, b in zip(groups, groups[1:], strict=False))
    return Traffic(
        sum(crossing) + sum(back),
        weights,
        sent * HASH_MESSAGE_BYTES / MICRO_BATCH,
        links * SIGNAL_BYTES_PER_LINK / BATCH,
        data_bytes,
    )


def sync_run(model: ModelFacts, speeds: Sequence[float]) -> tuple[float, float]:
    """(samples/s, bytes per sample) of data-parallel sync SGD: each worker downloads the fp32 weights and
    uploads a gradient every step; the step's batch is shared in proportion to speed."""
    step = 2 * link_time(model.params) + BATCH * model.train_flops / sum(speeds)
    return BATCH / step, len(speeds) * 2 * model.params / BATCH + model.data_bytes


def averaging_run(model: ModelFacts, speeds: Sequence[float]) -> tuple[float, float]:
    """The same for averaging (DiLoCo): LOCAL_STEPS local steps per worker per round, then the delta."""
    samples = len(speeds) * LOCAL_STEPS * MICRO_BATCH
    round_s = 2 * link_time(model.params) + samples * model.train_flops / sum(speeds)
    return samples / round_s, 2 * model.params / (LOCAL_STEPS * MICRO_BATCH) + model.data_bytes


# ---------------------------------------------------------------- churn


@dataclass
class Member:
    speed: float
    stage: int
    joins: float
    leaves: float


def population(
    stages: Sequence[StageFacts], groups: Sequence[Sequence[float]], horizon: float, rng: random.Random
) -> list[Member]:
    """Volunteers over time: exponential lifetimes; each departure brings a newcomer, who joins the stage
    with the least speed for its work (the server's rebalancing)."""
    rate = CHURN_PER_MIN / 60

    def life(start: float) -> float:
        return start + rng.expovariate(rate) if rate > 0 else math.inf

    members = [Member(s, k, 0.0, life(0.0)) for k, g in enumerate(groups) for s in g]
    departures = [(m.leaves, i) for i, m in enumerate(members)]
    heapq.heapify(departures)
    while departures and departures[0][0] < horizon:
        left, _ = heapq.heappop(departures)
        at = left + rng.uniform(0, JOIN_DELAY_S)
        present = [m for m in members if m.joins <= at < m.leaves]
        k = max(range(len(stages)), key=lambda k: _need(stages[k], present, k))
        members.append(Member(draw_speeds(1, rng)[0], k, at, life(at)))
        heapq.heappush(departures, (members[-1].leaves, len(members) - 1))
    return members


def _need(stage: StageFacts, present: Sequence[Member], k: int) -> float:
    return stage_work(stage) / max(sum(m.speed for m in present if m.stage == k), 1e-9)


@dataclass
class _Step:
    """One step's placement under churn: per member, when it is free and when its stage weights arrive."""

    stages: Sequence[StageFacts]
    members: Sequence[Member]
    start: float
    per_unit_grads: bool
    links: Sequence[float]
    free: dict[int, float] = field(default_factory=dict)
    done: dict[Unit, tuple[int, float]] = field(default_factory=dict)  # unit -> (member, end)
    lost_s: float = 0.0

    def available(self, i: int) -> float:
        m = self.members[i]
        return self.free.get(i, max(self.start, m.joins) + link_time(self.stages[m.stage].param_bytes))

    def duration(self, unit: Unit, i: int) -> float:
        stage, m = self.stages[unit.stage], self.members[i]
        last = unit.stage == len(self.stages) - 1
        work = stage.forward if unit.kind != BACKWARD else stage.backward + (stage.forward if last else 0.0)
        upload = link_time(stage.param_bytes) if self.per_unit_grads and unit.kind == BACKWARD else 0.0
        return work / m.speed + upload

    def place(self, unit: Unit, ready: float) -> None:
        """On the member finishing first; a member leaving mid-unit loses the unit, which is placed again
        once the server notices."""
        while True:
            here = [i for i, m in enumerate(self.members) if m.stage == unit.stage and m.leaves > ready]
            if not here:
                raise RuntimeError(f"stage {unit.stage} has no volunteer left: lengthen the population")
            ends = {i: max(ready, self.available(i)) + self.duration(unit, i) for i in here}
            i = min(ends, key=ends.__getitem__)
            start = ends[i] - self.duration(unit, i)
            if self.members[i].leaves >= ends[i]:
                self.free[i], self.done[unit] = ends[i], (i, ends[i])
                return
            self.lost_s += max(0.0, self.members[i].leaves - start)
            self.free[i], ready = math.inf, max(ready, self.members[i].leaves + DETECT_S)

    def ready(self, unit: Unit) -> float:
        arrivals = [self.start]
        for dep in dependencies(unit, len(self.stages)):
            link = self.links[min(dep.stage, unit.stage)] if dep.stage != unit.stage else 0.0
            arrivals.append(self.done[dep][1] + link)
        return max(arrivals)


def churn_step(
    stages: Sequence[StageFacts],
    members: Sequence[Member],
    start: float,
    links: Sequence[float],
    per_unit_grads: bool,
) -> tuple[float, float]:
    """(end of the step, compute time lost) for one GPipe step starting at ``start``."""
    step = _Step(stages, members, start, per_unit_grads, links)
    for unit in units(len(stages), MICRO_BATCHES):
        step.place(unit, step.ready(unit))
    if per_unit_grads:
        return max(end for _, end in step.done.values()), step.lost_s
    return _upload_accumulated(step), step.lost_s


def _upload_accumulated(step: _Step) -> float:
    """Each member sends its summed gradients after its last unit; one leaving first loses every backward
    unit it ran this step, which the server reissues (their inputs and output gradients it still has)."""
    for _ in range(20):
        last: dict[int, float] = {}
        for i, end in step.done.values():
            last[i] = max(last.get(i, 0.0), end)
        sent = {i: end + link_time(step.stages[step.members[i].stage].param_bytes) for i, end in last.items()}
        gone = [i for i, end in sent.items() if step.members[i].leaves < end]
        if not gone:
            return max(sent.values())
        for i in gone:
            orphans = [u for u, (j, _) in step.done.items() if j == i and u.kind == BACKWARD]
            step.free[i] = math.inf
            for unit in orphans:
                step.lost_s += step.duration(unit, i)
                step.place(unit, step.members[i].leaves + DETECT_S)
    return max(end for _, end in step.done.values())


def churn_throughput(
    stages: Sequence[StageFacts],
    members: Sequence[Member],
    horizon: float,
    links: Sequence[float],
    per_unit_grads: bool,
) -> tuple[float, float]:
    """(samples/s, volunteer-seconds of work lost to departures per step) over steps until ``horizon``."""
    now, steps, lost = 0.0, 0, 0.0
    while now < horizon:
        now, wasted = churn_step(stages, members, now, links, per_unit_grads)
        steps, lost = steps + 1, lost + wasted
    return steps * BATCH / now, lost / steps
