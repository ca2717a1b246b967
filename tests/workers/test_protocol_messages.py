"""workers/protocol.py's message fields the Contribute page reads: a result's loss (null for a unit that
computes none), and the recent average credit beside the total in `welcome`, `ack` and `credit`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from projects.lifecycle import ResultOutcome
from workers import protocol
from workers.preferences import DEFAULTS

RESULT: dict[str, Any] = {"type": "result", "work_unit": 7, "model_version": 2, "samples": 8}


def parsed_loss(loss: Any) -> float | None:
    message = protocol.parse_message(json.dumps({**RESULT, "loss": loss}))
    assert isinstance(message, protocol.ResultMessage)
    return protocol.result_meta(message).loss


def test_a_results_loss_is_a_finite_number_or_null() -> None:
    assert parsed_loss(None) is None  # a stage unit but the last stage's: no loss, not a loss of 0
    assert parsed_loss(0.0) == 0.0 and parsed_loss(2.5) == 2.5
    for refused in ("2.5", True, [1.0]):
        with pytest.raises(protocol.ProtocolError):
            parsed_loss(refused)
    with pytest.raises(protocol.ProtocolError):  # null, not absent: an old or broken client says so
        protocol.parse_message(json.dumps(RESULT))


def test_welcome_ack_and_credit_carry_the_recent_average_with_the_total() -> None:
    welcome = protocol.welcome_message(
        username="ann", credit_flops=10, recent_credit=0.125, preferences=DEFAULTS
    )
    assert welcome["volunteer"] == {"username": "ann", "credit_flops": 10, "recent_credit": 0.125}
    outcome = ResultOutcome(
        work_unit_id=7,
        status="pending",
        reason="",
        credit_flops=0,
        total_credit_flops=10,
        recent_credit=0.125,
    )
    ack = protocol.ack_message(outcome)
    assert (ack["total_credit_flops"], ack["recent_credit"]) == (10, 0.125)
    event = {"work_unit": 7, "status": "valid", "reason": "", "credit_flops": 5, "total_credit_flops": 15}
    credit = protocol.credit_message({**event, "recent_credit": 0.5, "type": "result.decided"})
    assert credit == {"type": "credit", **event, "recent_credit": 0.5}
