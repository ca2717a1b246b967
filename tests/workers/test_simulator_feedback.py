"""workers/simulator.py's honest wire format: a residual per project for every codec that drops something
(int8, int4, topk), started afresh when the project's codec changes. No server needed."""

from __future__ import annotations

import pytest
import torch

from engine import codecs
from workers.simulator import Simulator, SimulatorConfig, Unit


def unit(project: int, codec: str) -> Unit:
    raw = {"id": 1, "project": {"id": project}, "model_version": 1, "graph_url": "g", "weights_url": "w"}
    return Unit.parse({**raw, "shards": [], "batch_size": 8, "codec": codec})


@pytest.mark.parametrize("codec", ["int8", "int4", "topk"])
def test_the_simulator_carries_what_the_codec_dropped(codec: str) -> None:
    simulator = Simulator(SimulatorConfig())
    update = {"w": torch.randn(64, 80, generator=torch.Generator().manual_seed(1))}
    sent = [codecs.decode(simulator.encode(unit(3, codec), update))[0]["w"] for _ in range(4)]
    residual = simulator.feedback[3].residual["w"]
    torch.testing.assert_close(sum(sent) + residual, 4 * update["w"], atol=1e-4, rtol=1e-5)
    assert codecs.parse(simulator.encode(unit(3, codec), update)).meta["codec"] == codec
    fresh = simulator.encode(unit(4, codec), update)
    assert torch.equal(codecs.decode(fresh)[0]["w"], sent[0])  # project 4: its own, empty residual


def test_a_new_codec_starts_a_fresh_residual() -> None:
    simulator = Simulator(SimulatorConfig())
    update = {"w": torch.randn(300)}
    simulator.encode(unit(3, "int8"), update)
    first_topk = codecs.decode(simulator.encode(unit(3, "topk"), update))[0]["w"]
    assert torch.equal(first_topk, codecs.decode(codecs.encode(update, "topk", 4096))[0]["w"])
    assert torch.equal(codecs.decode(simulator.encode(unit(3, "fp32"), update))[0]["w"], update["w"])
