"""Activation blobs (engine/activations.py): the error budgets, the bytes, hostile input and the spot-check
rule. tests/browser/test_pipeline.py holds activations.js to the same bytes; tests/js/activations.test.mjs
checks it in Node against fixtures/activations.json, which test_the_node_fixture_is_current keeps current
(rewrite it with `python -m tests.engine.test_activations`)."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from engine import activations, codecs
from engine.activations import ActivationError

FIXTURE = Path(__file__).resolve().parents[1] / "js" / "fixtures" / "activations.json"


def wide(shape: tuple[int, ...], low: float, high: float, seed: int = 0) -> Tensor:
    """Normal values whose scale runs from 10**low to 10**high along the last dim: many magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * torch.logspace(low, high, shape[-1])


def samples() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(5)
    grads = wide((2, 3, 40), -12, -3, seed=1)  # activation gradients: tiny, of many magnitudes
    grads[1, 2, :] = 0.0  # an all-zero int8 block
    return {
        "grads": grads,
        "relu": torch.relu(torch.randn(3, 90, generator=gen) * 30),
        "ties": torch.tensor([[0.5, 1.5, 2.5, -0.5, 127.0, -63.5, 1.0, 0.0]]),  # round-half-even cases
        "octave_edges": torch.tensor([[2.0**-14, 2.0**15 - 1, -(2.0**20), 3.0 * 2.0**-140]]),
        "huge": torch.tensor([[1e38, -3e37, 1.0, 1e-30]]),
        "subnormal": torch.tensor([[2.0**-149, -(2.0**-140), 0.0]]),  # beyond the exponent's range
        "zeros": torch.zeros(2, 5),
        "empty": torch.zeros(0, 7),
    }


def roundtrip(
    x: Tensor, codec: str, block: int = activations.DEFAULT_BLOCK, kind: str = "activation"
) -> Tensor:
    data = activations.encode(x, codec, kind=kind, block_size=block)
    return activations.decode(data, list(x.shape), kind=kind, codec=codec)


# ---------------------------------------------------------------- budgets


@pytest.mark.parametrize(("codec", "block"), [("fp32", 256), ("fp16", 256), ("int8", 256), ("int8", 7)])
def test_decoding_stays_within_the_budget(codec: str, block: int) -> None:
    for name, x in samples().items():
        error = (roundtrip(x, codec, block).double() - x.double()).abs()
        assert bool((error <= activations.error_bound(x, codec, block)).all()), name


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_the_budget_is_nearly_reached(codec: str) -> None:
    """The bound is not loose: on random data some element uses more than 90% of it."""
    x = wide((64, 256), -3, 3)
    used = (roundtrip(x, codec).double() - x.double()).abs() / activations.error_bound(x, codec)
    assert 0.9 < float(used.max()) <= 1.0


def test_fp32_is_exact() -> None:
    for name, x in samples().items():
        assert torch.equal(roundtrip(x, "fp32"), x), name


def test_fp16_keeps_the_relative_precision_of_gradients_plain_fp16_flushes() -> None:
    """Gradients of 1e-12..1e-6: plain fp16 (codecs) loses them below 6e-5; scaled fp16 keeps each element
    within 2**-11 relative (they all lie within 2**-28 of the largest)."""
    x = wide((8, 64), -9, -6)
    x[x.abs() < 1e-12] = 1e-12
    scaled = (roundtrip(x, "fp16") - x).abs() / x.abs()
    plain = (codecs.decode(codecs.encode({"x": x}, "fp16"))[0]["x"] - x).abs() / x.abs()
    assert float(scaled.max()) <= 2.0**-11 < 0.5 < float(plain.max())


@pytest.mark.parametrize("exponent_of_top", [-149, -126, -100, -30, -14, 0, 14, 15, 40, 126])
def test_the_largest_magnitude_is_scaled_into_the_top_octave(exponent_of_top: int) -> None:
    top = 1.5 * 2.0**exponent_of_top
    x = torch.tensor([top, -top / 3, top / 1000])
    k = activations.half_exponent(x)
    assert activations.MIN_EXPONENT <= k <= activations.MAX_EXPONENT
    if exponent_of_top + k == activations.HALF_TOP:
        assert 2.0**14 <= float(x.abs().max()) * 2.0**k < 2.0**15
    else:  # clamped: float32 cannot hold the multiplier 2**-k
        assert k == activations.MAX_EXPONENT and exponent_of_top < -113


def test_blobs_are_codecs_blobs() -> None:
    """engine.codecs reads every activation blob: fp32 and int8 unchanged, fp16 as the scaled values."""
    x = wide((3, 40), -4, 2)
    for codec in activations.CODECS:
        data = activations.encode(x, codec, kind="gradient")
        tensors, meta = codecs.decode(data)
        assert list(tensors) == ["gradient"] and meta["codec"] == codec
        scale = 2.0 ** -int(meta.get("exponent", "0"))
        assert torch.equal(tensors["gradient"] * scale, activations.decode(data, [3, 40], kind="gradient"))


def test_the_same_tensor_gives_the_same_bytes_and_address() -> None:
    x = wide((5, 9), -2, 2)
    for codec in activations.CODECS:
        data = activations.encode(x, codec)
        assert data == activations.encode(x.clone(), codec)
        assert (
            activations.digest(data) == activations.digest(bytearray(data)) != activations.digest(data + b" ")
        )


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("value", "codec", "message"),
    [
        (torch.tensor([1.0, math.nan]), "fp16", "non-finite"),
        (torch.tensor([1.0, math.inf]), "fp32", "non-finite"),
        (torch.tensor([1, 2]), "fp16", "float tensor"),
        (torch.tensor([2.0**127]), "fp16", "2\\*\\*127"),
        (torch.tensor([-(2.0**127)]), "int8", "2\\*\\*127"),
        (torch.ones(2), "fp8", "unknown codec"),
    ],
)
def test_encode_refuses(value: Tensor, codec: str, message: str) -> None:
    with pytest.raises(ActivationError, match=message):
        activations.encode(value, codec)


def test_encode_refuses_an_unknown_kind_and_fp32_takes_any_finite_value() -> None:
    with pytest.raises(ActivationError, match="unknown kind"):
        activations.encode(torch.ones(2), "fp16", kind="weights")
    big = torch.tensor([3e38, -3e38])
    assert torch.equal(roundtrip(big, "fp32"), big)


def tamper(data: bytes, change: Callable[[dict[str, Any]], None], body: bytes | None = None) -> bytes:
    """The blob with its header changed (and re-padded), and its data replaced if ``body`` is given."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + (data[8 + size :] if body is None else body)


def meta(**changes: str | None) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        for key, value in changes.items():
            if value is None:
                header["__metadata__"].pop(key)
            else:
                header["__metadata__"][key] = value

    return change


def entry(name: str = "activation", **changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header[name].update(changes)


def replace_float(data: bytes, tensor: str, value: float) -> bytes:
    """The blob with the first float32 of ``tensor`` replaced by ``value``."""
    (size,) = struct.unpack("<Q", data[:8])
    start = 8 + size + json.loads(data[8 : 8 + size])[tensor]["data_offsets"][0]
    return data[:start] + struct.pack("<f", value) + data[start + 4 :]


def hostile_blobs() -> dict[str, tuple[bytes, list[int], str]]:
    """Each: (bytes, the shape the receiver expects, the kind it expects): every one must be refused."""
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    half, int8 = activations.encode(x, "fp16"), activations.encode(x, "int8", block_size=4)
    fp32 = activations.encode(x, "fp32")
    unscaled = codecs.encode({"activation": torch.ones(2, 6, dtype=torch.int8)}, "fp32")
    nan_half = tamper(half, lambda h: None, body=struct.pack("<12e", *([math.nan] * 12)))
    inf_half = tamper(half, lambda h: None, body=struct.pack("<12e", *([math.inf] + [1.0] * 11)))
    too_big_scale = replace_float(int8, "activation:scale", 3e38)  # 127 * 3e38 is no float32
    huge_header = (
        struct.pack("<Q", activations.MAX_HEADER + 8) + b" " * (activations.MAX_HEADER + 8) + half[8:]
    )
    cases: dict[str, tuple[bytes, list[int] | None, str]] = {
        "empty": (b"", None, "activation"),
        "truncated": (half[:-1], None, "activation"),
        "longer": (half + b"\0\0", None, "activation"),
        "header over the bound": (huge_header, None, "activation"),
        "header length past the end": (struct.pack("<Q", 2**40) + half[8:], None, "activation"),
        "not json": (struct.pack("<Q", 8) + b"{{{{{{{{" + half[-24:], None, "activation"),
        "other shape": (half, [3, 4], "activation"),
        "other rank": (half, [12], "activation"),
        "other kind": (half, None, "gradient"),
        "nan": (nan_half, None, "activation"),
        "inf": (inf_half, None, "activation"),
        "inf scale": (replace_float(int8, "activation:scale", math.inf), None, "activation"),
        "scale overflowing": (too_big_scale, None, "activation"),
        "nan in fp32": (replace_float(fp32, "activation", math.nan), None, "activation"),
        "no exponent": (tamper(half, meta(exponent=None)), None, "activation"),
        "exponent in fp32": (tamper(fp32, meta(exponent="3")), None, "activation"),
        "exponent out of range": (tamper(half, meta(exponent="300")), None, "activation"),
        "exponent below range": (tamper(half, meta(exponent="-113")), None, "activation"),
        "exponent not a number": (tamper(half, meta(exponent="1e3")), None, "activation"),
        "exponent with a plus": (tamper(half, meta(exponent="+3")), None, "activation"),
        "unknown codec": (tamper(half, meta(codec="fp8")), None, "activation"),
        "no codec": (tamper(half, meta(codec=None)), None, "activation"),
        "no block size": (tamper(int8, meta(block_size=None)), None, "activation"),
        "block size of zero": (tamper(int8, meta(block_size="0")), None, "activation"),
        "extra metadata": (tamper(half, meta(note="hi")), None, "activation"),
        "bf16 for fp16": (tamper(half, entry(dtype="BF16")), None, "activation"),
        "int8 claims fp32": (tamper(int8, meta(codec="fp32")), None, "activation"),
        "fp32 claims int8": (tamper(fp32, meta(codec="int8")), None, "activation"),
        "scale missing": (tamper(unscaled, meta(codec="int8")), None, "activation"),
        "lying offsets": (tamper(half, entry(data_offsets=[0, 20])), None, "activation"),
        "extra tensor": (codecs.encode({"activation": x, "more": x}, "fp32"), None, "activation"),
        "negative size": (tamper(fp32, entry(shape=[-2, -6])), None, "activation"),
    }
    return {name: (data, shape or [2, 6], kind) for name, (data, shape, kind) in cases.items()}


def test_every_hostile_blob_is_refused() -> None:
    for what, (data, shape, kind) in hostile_blobs().items():
        with pytest.raises(ActivationError):
            activations.decode(data, shape, kind=kind)
            pytest.fail(f"accepted {what}")


def test_a_blob_of_another_codec_than_asked_is_refused() -> None:
    data = activations.encode(torch.ones(2, 2), "fp16")
    with pytest.raises(ActivationError, match="codec"):
        activations.decode(data, [2, 2], codec="int8")


# ---------------------------------------------------------------- the spot-check rule


def test_an_honest_blob_passes_the_spot_check() -> None:
    x = wide((4, 300), -3, 1)
    recomputed = x * (1 + 1e-6 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2)))
    for codec in activations.CODECS:
        for kind in activations.KINDS:
            check = activations.spot_check(roundtrip(x, codec, kind=kind), recomputed, codec, kind=kind)
            assert check.accepted and check.outliers == 0 and check.worst <= 1.0, (codec, kind, check)


def test_a_changed_activation_fails_the_spot_check() -> None:
    x = wide((4, 300), -3, 1)
    sent = roundtrip(x, "fp16")
    allowed = activations.error_bound(x, "fp16") + 1e-4 * float(x.abs().max())
    sent[2, 7] += 3 * float(allowed[2, 7])
    check = activations.spot_check(sent, x, "fp16")
    assert not check.accepted and check.outliers == 1 and check.worst > 2


def reroute(g: Tensor, pairs: int, seed: int = 0) -> Tensor:
    """A max-pool tie broken the other way: a gradient moved to another position of the same sample."""
    gen, out = torch.Generator().manual_seed(seed), g.clone()
    flat = out.view(g.shape[0], -1)
    for n in range(pairs):
        row, (a, b) = n % g.shape[0], torch.randperm(flat.shape[1], generator=gen)[:2].tolist()
        flat[row, b] += flat[row, a]
        flat[row, a] = 0.0
    return out


def test_gradients_may_differ_where_a_max_pool_tie_is_broken_the_other_way() -> None:
    g = wide((4, 2, 32, 32), -4, -2)
    few, many = reroute(g, 40), reroute(g, 400)  # 1% and 10% of the 8192 elements
    tie = activations.spot_check(roundtrip(few, "int8", kind="gradient"), g, "int8", kind="gradient")
    assert tie.accepted and 0 < tie.share <= activations.TIE_SHARE
    assert not activations.spot_check(few, g, "int8", kind="activation").accepted  # not for activations
    assert not activations.spot_check(many, g, "int8", kind="gradient").accepted
    shifted = few.clone()
    shifted[0, 0, 0, :40] += 0.5 * float(g.abs().max())  # within the tie bounds, but the sample's sum grows
    assert not activations.spot_check(shifted, g, "int8", kind="gradient").accepted
    oversized = g.clone()
    oversized[1, 1, 3, 3], oversized[1, 1, 3, 4] = 5.0, oversized[1, 1, 3, 4] - 5.0  # sum kept, too large
    assert not activations.spot_check(oversized, g, "int8", kind="gradient").accepted


# ---------------------------------------------------------------- the Node fixture


def _floats(x: Tensor) -> str:
    return base64.b64encode(x.contiguous().float().numpy().tobytes()).decode()


def node_fixture() -> dict[str, Any]:
    """Blobs activations.js must encode byte for byte and decode bit for bit, and blobs it must refuse."""
    cases: list[dict[str, Any]] = []
    for i, (name, x) in enumerate(samples().items()):
        for j, (codec, block) in enumerate((("fp32", 256), ("fp16", 256), ("int8", 256), ("int8", 7))):
            kind = activations.KINDS[(i + j) % 2]
            data = activations.encode(x, codec, kind=kind, block_size=block)
            decoded = activations.decode(data, list(x.shape), kind=kind)
            cases.append(
                {
                    "name": name,
                    "shape": list(x.shape),
                    "values": _floats(x),
                    "codec": codec,
                    "kind": kind,
                    "block": block,
                    "blob": base64.b64encode(data).decode(),
                    "decoded": _floats(decoded),
                    "exponent": activations.half_exponent(x),
                }
            )
    hostile = [
        {"name": what, "blob": base64.b64encode(data).decode(), "shape": shape, "kind": kind}
        for what, (data, shape, kind) in hostile_blobs().items()
    ]
    return {"cases": cases, "hostile": hostile}


def fixture_text() -> str:
    return json.dumps(node_fixture(), indent=1) + "\n"


def test_the_node_fixture_is_current() -> None:
    assert FIXTURE.read_text() == fixture_text(), "run `python -m tests.engine.test_activations`"


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(fixture_text())
    print(f"wrote {FIXTURE}")
