"""The pipeline benchmark's stated assumptions: volunteer speeds, links, step shape, churn."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
SEED = 14

# Effective training speed in a browser tab (WebGL/WebGPU), GFLOP/s, and the share of volunteers of each kind.
DEVICES = {"phone": (15.0, 0.3), "laptop": (50.0, 0.4), "desktop": (150.0, 0.3)}
BANDWIDTH_MBIT = 100.0  # every volunteer's link, each way
LATENCY_S = 0.020  # one way, per message
HASH_MESSAGE_BYTES = 96  # with the ring, the server still gets a digest (and its framing) per activation sent
# Signalling one WebRTC link through the server (offer, answer, candidates), as tests/browser/test_ring.py
# measured it; counted for every pair of volunteers of adjacent stages at every step (links kept open
# across steps would cost it once).
SIGNAL_BYTES_PER_LINK = 2_066
SERVER_STEP_S = 0.0  # the optimizer step on the server is not emulated

# Models: a GPT (engine/presets.py) at several widths, 8 blocks, 64-token sequences; the CIFAR ResNet-18.
GPT_WIDTHS = (32, 64, 128, 256, 512, 1024)
GPT_LAYERS = 8
BUDGET_BYTES = 512 * 2**20  # per-device memory budget (weights, gradients, one micro-batch's activations)

# A step: M micro-batches of MICRO_BATCH samples (GPT: sequences of 64 tokens).
MICRO_BATCH = 4
MICRO_BATCHES = 16
STAGES = (2, 4, 8)
BUBBLE_MICRO_BATCHES = (4, 8, 16, 32)  # the bubble is also measured at these M (one volunteer per stage)
PER_STAGE = (1, 2, 3, 4)

# Data-parallel averaging (DiLoCo): samples per worker per round, in local steps of MICRO_BATCH.
LOCAL_STEPS = 16

# Churn: each volunteer leaves at this rate (exponential lifetimes); each departure brings a newcomer after a
# delay drawn uniformly in [0, JOIN_DELAY_S]; the server notices a departure after DETECT_S (socket closed).
CHURN_PER_MIN = 0.2
JOIN_DELAY_S = 60.0
DETECT_S = 2.0
CHURN_MINUTES = 20.0
CHURN_TRIALS = 3

BYTES_PER_S = BANDWIDTH_MBIT * 1e6 / 8


def link_time(size: float) -> float:
    """One message of ``size`` bytes over one volunteer link."""
    return LATENCY_S + size / BYTES_PER_S
