"""What the scaling benchmark runs: its constants, its two methods and the options of one invocation."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ADMIN_URL = os.environ.get("E2E_ADMIN_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
DATABASE_PREFIX = "crowdtrain_h10"  # databases <prefix>_template and <prefix>_<method>_<n>
REDIS_DB = 2
BANDWIDTH_MBIT = 100.0
LATENCY_MS = 20.0
SHARD_SAMPLES = 6000  # 10 training shards; 3,000-sample work units fit evenly
UNITS_PER_ROUND = 16
LOCAL_MINIBATCH = 64
PASSWORD = "h10-scaling-volunteer-pass"
GOAL_SPEEDUP, GOAL_BYTES = 10.0, 0.02
GOAL_BYTES_4BIT = 1 / 400  # issue 15 item 6 (INTELLECT-1's reduction), for the avg_4bit method
# The heterogeneous runs (issue 15 items 7 and 5): speedup over one volunteer of the fleet's mean speed at 64
# volunteers, and the share of its wall time a device computes.
GOAL_HETERO_SPEEDUP, GOAL_HETERO_AT, GOAL_BUSY = 48.0, 64, 0.95
CHURN_PER_HOUR = 0.2
DEVICE_NICE = 19  # the emulated volunteers' CPU priority: the lowest (emulation.device_pool)
DEVICE_PROCESSES = 4  # processes the emulated volunteers train in (emulation.device_processes); 0: threads
TARGET_SECONDS = 40  # the crowd method's work units take this long on each device


@dataclass(frozen=True)
class Method:
    label: str
    work_unit: int  # batch_size: samples per work unit; a round is UNITS_PER_ROUND of them
    settings: dict[str, Any]  # project columns
    why: str


METHODS_AVG_SETTINGS: dict[str, Any] = {
    "mode": "averaging",
    "codec": "int8",
    "weights_codec": "int8",
    "learning_rate": 1.0,
    "momentum": 0.9,
    "local_learning_rate": 0.05,
    "local_momentum": 0.9,
    "local_batch_size": LOCAL_MINIBATCH,
}

CROWD_SETTINGS: dict[str, Any] = {
    **METHODS_AVG_SETTINGS,
    "crowd_rounds": True,
    "target_seconds": TARGET_SECONDS,
    "round_samples": LOCAL_MINIBATCH * UNITS_PER_ROUND,
    "round_timeout": 4 * TARGET_SECONDS,
    "weights_delta_codec": "int8",  # as the demos: a device holding the last version gets its delta
}

METHODS: dict[str, Method] = {
    "sync": Method(
        "fp32 sync_sgd (gradients every step)",
        64,
        {"mode": "sync_sgd", "codec": "fp32", "weights_codec": "fp32", "learning_rate": 0.2, "momentum": 0.9},
        "a step = 16 gradients of 64 samples (batch 1,024), server SGD lr 0.2 momentum 0.9 (offline: 118 "
        "steps to 84%; lr 0.1 and 0.4 took 139 and 149); weights down and gradients up in fp32",
    ),
    "avg": Method(
        "int8 averaging (local steps, int8 both ways)",
        3000,
        METHODS_AVG_SETTINGS,
        "a round = 16 work units of 3,000 samples (48,000, 0.8 epoch), each 47 local SGD steps of 64 "
        "(lr 0.05, momentum 0.9) in the volunteer; outer Nesterov lr 1.0 momentum 0.9 on the sample-weighted "
        "mean delta (offline: 6 rounds to 84%, 7-8 with outer lr 0.7); updates int8 with error feedback, "
        "weights int8",
    ),
    "avg_crowd": Method(
        "int8 averaging, crowd rounds (a unit per device, target_seconds each)",
        LOCAL_MINIBATCH,
        CROWD_SETTINGS,
        f"the platform's crowd-sized rounds as in production: a round has a work unit for every connected "
        f"device (at least {UNITS_PER_ROUND}), each sized to take {TARGET_SECONDS} s of local SGD steps "
        "of 64 (lr 0.05, momentum 0.9) on that device, so the round grows with the fleet and its devices "
        "finish together; outer Nesterov lr 1.0 momentum 0.9 on the sample-weighted mean delta; int8 "
        "updates, weights down as int8 deltas",
    ),
    "avg_crowd_overlap": Method(
        "int8 averaging, crowd rounds that overlap (DiLoCo's one-step-delayed outer update)",
        LOCAL_MINIBATCH,
        # A delta one version stale under outer Nesterov momentum 0.9 at lr 1.0 overshot: 75.7% at version 2,
        # 44.3% at version 5. Half the outer step and no momentum instead.
        {**CROWD_SETTINGS, "overlap_rounds": True, "learning_rate": 0.5, "momentum": 0.0},
        "avg_crowd's rounds, but no device waits for one to close (issue 15 item 5): a device that ends its "
        "unit is sent its next at once, every unit takes target_seconds, and work still in flight when a "
        "round closes is averaged into the next round, one version stale, at full weight",
    ),
    "avg_4bit": Method(
        "int4 model averaging, 24,000-sample units (issue 15 item 6: 1/400 of sync's bytes)",
        24000,
        {
            **METHODS_AVG_SETTINGS,
            "codec": "int4",
            "weights_codec": "int4",
            "weights_delta_codec": "int4",
            "momentum": 0.0,
        },
        "a round = 16 work units of 24,000 samples (384,000, 6.4 epochs), each 375 local SGD steps of 64 "
        "(lr 0.05, momentum 0.9) in the volunteer, across 4-5 of the 6,000-sample shards; plain model "
        "averaging (outer lr 1.0, no momentum); updates int4 with error feedback, the first weights int4, "
        "then each version as an int4 delta (offline, benchmarks/scaling/bytes.py: 2 rounds to 84%, 1/452 "
        "of sync's bytes)",
    ),
}


def round_columns(method: Method) -> dict[str, Any]:
    """The benchmark project's columns for `method` (recorded with every run)."""
    return {
        "batch_size": method.work_unit,
        "round_samples": method.work_unit * UNITS_PER_ROUND,
        "round_timeout": 120,
        "target_seconds": 600,  # every work unit is batch_size: same-speed devices, no splitting
        **method.settings,
    }


@dataclass(frozen=True)
class Options:
    """One invocation, from the command line."""

    quick: bool
    volunteers: list[int]
    methods: list[str]
    target: float
    gflops: float | None  # None: calibrated
    timeout: float | None  # None: from the emulated speed
    output: Path | None  # None: benchmarks/results/scaling.json
    database_prefix: str = DATABASE_PREFIX
    redis_db: int = REDIS_DB
    heterogeneous: bool = False  # speeds spread 10x with churn (fleet.py), into their own results file
    churn_per_hour: float = CHURN_PER_HOUR
    device_nice: int = DEVICE_NICE
    device_processes: int = DEVICE_PROCESSES
    prefetch: bool = True

    @property
    def name(self) -> str:
        return "scaling-heterogeneous" if self.heterogeneous else "scaling"

    @property
    def results(self) -> Path:
        return self.output or RESULTS / f"{self.name}.json"

    @property
    def partial(self) -> Path:
        """Rows written after every run, so that a crash late in the series loses nothing."""
        return Path(f"{self.output}.partial") if self.output else RESULTS / f"{self.name}.partial.json"

    @property
    def template_database(self) -> str:
        return f"{self.database_prefix}_template"

    def database(self, method: str, volunteers: int) -> str:
        return f"{self.database_prefix}_{method}_{volunteers}"

    @property
    def var_dir(self) -> Path:
        """Shared by all runs (blobs are content-addressed and immutable, logs are per run)."""
        return Path(tempfile.gettempdir()) / f"{self.database_prefix.replace('_', '-')}-scaling"
