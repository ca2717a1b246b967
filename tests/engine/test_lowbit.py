"""The int4 and topk codecs (engine/lowbit.py through engine/codecs.py): their arithmetic, their blobs read in
place (norm, fold), error feedback, and hostile blobs refused. tests/js/codecs.test.mjs checks codecs.js in
Node against fixtures/codecs.json (the Python bytes), which test_the_node_fixture_is_current keeps current:
`python -m tests.engine.test_lowbit` rewrites it."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import random
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from torch import Tensor

from engine import codecs, lowbit
from engine.codecs import CodecError, ErrorFeedback, decode, encode, parse, weights_delta

FIXTURE = Path(__file__).resolve().parents[1] / "js" / "fixtures" / "codecs.json"
# (codec, block_size, keep) the fixture and the browser test cover.
CONFIGS = [("int4", 256, None), ("int4", 6, None), ("topk", 64, 5), ("topk", 7, 3), ("topk", 4096, None)]


def samples() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(3, 70, generator=gen) * torch.logspace(-6, 2, 70)  # many magnitudes
    wide[0, :64] = 0.0  # an all-zero block
    return {
        "w": wide,
        "b": torch.randn(37, generator=gen),
        "ties": torch.tensor([1.0, -1.0, 1.0, 0.5, -0.5, 3.5, -3.5, 0.0, 1.0, 2.5, -2.5]),  # equal magnitudes
        "s": torch.tensor(-2.0),
    }


def _b64(t: Tensor) -> str:
    return base64.b64encode(t.float().contiguous().numpy().tobytes()).decode()


def fixture_text() -> str:
    tensors = samples()
    cases = []
    for codec, block, keep in CONFIGS:
        data = encode(tensors, codec, block, keep=keep)
        decoded = decode(data)[0]
        cases.append(
            {
                "codec": codec,
                "block": block,
                "keep": keep,
                "blob": base64.b64encode(data).decode(),
                "decoded": {name: _b64(t) for name, t in decoded.items()},
            }
        )
    feedback = []
    for codec, block, keep in CONFIGS[::2]:
        ef = ErrorFeedback(codec, block, keep)
        sent = [base64.b64encode(ef.compress(update)).decode() for update in ef_updates()]
        feedback.append({"codec": codec, "block": block, "keep": keep, "sent": sent})
    doc = {
        "tensors": {name: {"shape": list(t.shape), "values": _b64(t)} for name, t in tensors.items()},
        "cases": cases,
        "updates": [{n: _b64(t) for n, t in u.items()} for u in ef_updates()],
        "feedback": feedback,
        "deltas": [delta_chain(tensors, codec) for codec in ("int8", "int4", "topk")],
    }
    return json.dumps(doc, indent=0) + "\n"


def delta_chain(tensors: dict[str, Tensor], codec: str) -> dict[str, object]:
    """Weights down as deltas from `tensors` (held first): each delta's bytes and what holding it gives."""
    gen = torch.Generator().manual_seed(11)
    weights, held, steps = dict(tensors), dict(tensors), []
    for _ in range(3):
        weights = {
            n: t + 0.1 * torch.randn(t.shape, generator=gen) * t.abs().mean() for n, t in weights.items()
        }
        data, held = weights_delta(held, weights, codec)
        steps.append({"blob": base64.b64encode(data).decode(), "held": {n: _b64(t) for n, t in held.items()}})
    return {"codec": codec, "steps": steps}


def ef_updates() -> list[dict[str, Tensor]]:
    """Updates with a steady part, so what a codec drops piles up without feedback, plus noise."""
    gen = torch.Generator().manual_seed(9)
    steady = torch.randn(3, 100, generator=gen) * torch.logspace(-4, 0, 100)
    return [{"w": steady * (1 + 0.05 * torch.randn(steady.shape, generator=gen))} for _ in range(6)]


def test_the_node_fixture_is_current() -> None:
    assert FIXTURE.read_text() == fixture_text(), "run `python -m tests.engine.test_lowbit`"


# --- the arithmetic -----------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [256, 6, 2])
def test_int4_is_int8s_formula_with_seven_levels_two_codes_a_byte(block: int) -> None:
    tensors = samples()
    data = encode(tensors, "int4", block)
    raw, decoded = st_load(data), decode(data)[0]
    for name, t in tensors.items():
        flat = t.reshape(-1)
        padded = torch.cat([flat, flat.new_zeros(-flat.numel() % block)]).view(-1, block)
        scale = padded.abs().amax(1) / 7
        codes = (padded / torch.where(scale > 0, scale, 1.0)[:, None]).round().clamp(-7, 7)
        assert torch.equal(raw[name + ":scale"], scale), name
        assert raw[name].dtype == torch.uint8 and raw[name].numel() == math.ceil(flat.numel() / 2)
        want = (codes * scale[:, None]).reshape(-1)[: flat.numel()].view(t.shape)
        assert torch.equal(decoded[name], want), name
        # Within half a step of its block.
        step = (scale[:, None].expand_as(padded).reshape(-1)[: flat.numel()] / 2).view(t.shape)
        assert bool(((decoded[name] - t).abs() <= step * (1 + 1e-6)).all()), name


def test_nibbles_round_trip_with_a_zero_pad() -> None:
    codes = torch.tensor([-8, 7, 0, -7, 3], dtype=torch.int8)
    packed = lowbit.pack_nibbles(codes)
    assert packed.tolist() == [0 | (15 << 4), 8 | (1 << 4), 11 | (8 << 4)]
    assert lowbit.unpack_nibbles_into(packed, torch.empty(6)).tolist() == [-8, 7, 0, -7, 3, 0]


@pytest.mark.parametrize(("block", "keep"), [(64, 5), (7, 3), (4096, 64), (5, 5)])
def test_topk_keeps_the_largest_per_block_with_ties_to_the_lower_index(block: int, keep: int) -> None:
    for name, t in samples().items():
        flat = t.reshape(-1)
        kept = decode(encode({name: t}, "topk", block, keep=keep))[0][name].reshape(-1)
        for lo in range(0, flat.numel(), block):
            part = flat[lo : lo + block].tolist()
            order = sorted(range(len(part)), key=lambda i: (-abs(part[i]), i))[:keep]
            nonzero = {i for i in range(len(part)) if kept[lo + i] != 0}
            assert nonzero <= set(order), (name, lo)
            chosen = flat[lo : lo + block][sorted(order)]
            scale = chosen.abs().max() / 127
            want = (chosen / scale).round() * scale if scale > 0 else chosen
            assert torch.equal(kept[lo : lo + block][sorted(order)], want), (name, lo)


def test_topk_layout_counts_and_offsets() -> None:
    data = encode({"w": torch.arange(10.0)}, "topk", 4, keep=3)
    raw, meta = st_load(data), parse(data).meta
    assert meta["keep"] == "3" and meta["shape:w"] == "10" and meta["codec"] == "topk"
    # Blocks [0..3] [4..7] [8, 9]: the 3 largest of each (the last keeps both), offsets within the block.
    assert raw["w:index"].dtype == torch.int16 and raw["w:index"].tolist() == [1, 2, 3, 1, 2, 3, 0, 1]
    assert lowbit.topk_count(10, 4, 3) == 8 and raw["w"].numel() == 8 and raw["w:scale"].numel() == 3
    assert decode(data)[0]["w"].tolist() == pytest.approx([0, 1, 2, 3, 0, 5, 6, 7, 8, 9], rel=0.01)


@pytest.mark.parametrize(("codec", "block", "keep"), CONFIGS)
def test_norm_and_fold_read_the_blob_in_place(codec: str, block: int, keep: int | None) -> None:
    tensors = {k: v for k, v in samples().items()}
    packed = parse(encode(tensors, codec, block, keep=keep))
    decoded = packed.decode()
    want = sum(float(t.double().square().sum()) for t in decoded.values())
    assert packed.sq_norm() == pytest.approx(want, rel=1e-6)  # float32 products decoded
    sums = {name: torch.ones(t.shape) for name, t in tensors.items()}
    packed.add_to(sums, 0.5)
    for name in tensors:
        torch.testing.assert_close(sums[name], 1 + 0.5 * decoded[name], rtol=0, atol=1e-6)
        assert packed.is_float(name) and packed.shape(name) == tuple(tensors[name].shape)
        assert packed.finite(name)


def test_int4_fold_goes_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecs, "CHUNK", 64)  # many chunks, and a partial one
    t = torch.randn(1000)
    packed = parse(encode({"t": t}, "int4", 16))
    sums = {"t": torch.zeros(1000)}
    packed.add_to(sums, 1.0)
    assert torch.equal(sums["t"], packed["t"])


def test_labels_pass_through_and_the_codecs_need_their_parameters() -> None:
    y = torch.arange(-3, 9)
    for codec in codecs.LOWBIT:
        assert torch.equal(decode(encode({"y": y, "x": torch.ones(3)}, codec))[0]["y"], y)
    with pytest.raises(CodecError, match="even"):
        encode({"a": torch.ones(3)}, "int4", 7)
    with pytest.raises(CodecError, match="keep"):
        encode({"a": torch.ones(3)}, "topk", 8, keep=9)
    with pytest.raises(CodecError, match="keep"):
        encode({"a": torch.ones(3)}, "topk", 1 << 16)
    with pytest.raises(CodecError, match="collides"):
        encode({"a": torch.ones(3), "a:index": torch.ones(2)}, "topk")


@pytest.mark.parametrize(("codec", "keep"), [("int4", None), ("topk", 4)])
def test_error_feedback_sends_everything_eventually(codec: str, keep: int | None) -> None:
    """What was sent plus the residual is exactly what was given (telescoping), and the sum sent tracks the
    true sum far better than compressing each update alone."""
    updates = ef_updates()
    feedback = ErrorFeedback(codec, 64, keep)
    sent = torch.stack([decode(feedback.compress(u))[0]["w"] for u in updates]).sum(0)
    true = torch.stack([u["w"] for u in updates]).sum(0)
    torch.testing.assert_close(sent + feedback.residual["w"], true, atol=1e-5, rtol=1e-5)
    plain = torch.stack([decode(encode(u, codec, 64, keep=keep))[0]["w"] for u in updates]).sum(0)
    assert float((sent - true).norm()) < 0.5 * float((plain - true).norm())


def test_the_defaults() -> None:
    assert ErrorFeedback("topk").block_size == 4096 and ErrorFeedback("int4").block_size == 256
    assert parse(encode({"a": torch.ones(5000)}, "topk", 4096)).meta["keep"] == "64"


# --- weights down as deltas ---------------------------------------------------------------------------


@pytest.mark.parametrize(("codec", "keep"), [("topk", 16), ("int4", None)])
def test_a_volunteer_applying_the_deltas_holds_exactly_what_the_server_tracks(
    codec: str, keep: int | None
) -> None:
    gen = torch.Generator().manual_seed(2)
    weights = {"w": torch.randn(40, 50, generator=gen), "b": torch.randn(50, generator=gen)}
    down = codecs.WeightsDeltas(weights, codec, "int4", 256, keep)
    held = decode(down.first)[0]  # the volunteer's first download
    assert parse(down.first).meta["codec"] == "int4"
    steps = [{k: 0.01 * torch.randn(v.shape, generator=gen) for k, v in weights.items()} for _ in range(30)]
    for step in steps:
        weights = {k: v + step[k] for k, v in weights.items()}
        for name, value in decode(down.delta(weights))[0].items():
            held[name] = held[name] + value
        assert all(torch.equal(held[k], down.held[k]) for k in weights)
    # Feedback: what was dropped (and the first download's int4 error) is sent later, so the gap is about
    # one step's worth (measured: 1.6 for topk, 0.13 for int4); deltas sent alone stay 9-14 steps off.
    gap = max(float((down.held[k] - weights[k]).norm() / steps[-1][k].norm()) for k in weights)
    assert gap < 3, gap


def test_a_delta_for_other_tensors_is_refused() -> None:
    held = {"w": torch.zeros(4), "b": torch.zeros(2)}
    data, _ = weights_delta({"w": torch.zeros(4)}, {"w": torch.ones(4)}, "int8")
    with pytest.raises(CodecError, match="not the weights'"):
        codecs.apply_delta(held, data)


# --- hostile blobs ------------------------------------------------------------------------------------


def _blob(header: dict[str, object], body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _topk(
    offsets: list[int], elements: int = 8, block: int = 4, keep: int = 2, extra: dict[str, str] | None = None
) -> bytes:
    """A handwritten topk blob of one tensor 'w', with the given offsets."""
    m, blocks = len(offsets), math.ceil(elements / block)
    body = struct.pack(f"<{blocks}f", *[1.0] * blocks) + struct.pack(f"<{m}h", *offsets) + bytes([1] * m)
    header = {
        "__metadata__": {
            "codec": "topk",
            "block_size": str(block),
            "keep": str(keep),
            "shape:w": str(elements),
        }
        | (extra or {}),
        "w:scale": {"dtype": "F32", "shape": [blocks], "data_offsets": [0, 4 * blocks]},
        "w:index": {"dtype": "I16", "shape": [m], "data_offsets": [4 * blocks, 4 * blocks + 2 * m]},
        "w": {"dtype": "I8", "shape": [m], "data_offsets": [4 * blocks + 2 * m, 4 * blocks + 3 * m]},
    }
    return _blob(header, body)


def test_a_handwritten_topk_blob_decodes() -> None:
    assert decode(_topk([0, 3, 1, 2]))[0]["w"].tolist() == [1, 0, 0, 1, 0, 1, 1, 0]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_topk([0, 4, 1, 2]), "offsets"),  # outside its block
        (_topk([0, 3, 1, -1]), "offsets"),
        (_topk([3, 3, 1, 2]), "offsets"),  # a position twice
        (_topk([3, 0, 1, 2]), "offsets"),  # not increasing
        (_topk([0, 1, 0, 3], elements=7), "offsets"),  # the last block holds 3 values: 3 is past it
        (_topk([0, 1, 0, 1, 0]), "malformed"),  # more values than the shape keeps
        (_topk([0, 1, 0]), "malformed"),  # fewer
        (_topk([0, 1, 0, 1], keep=0), "keep"),
        (_topk([0, 1, 0, 1], keep=5), "keep"),
        (_topk([0, 1, 0, 1], extra={"keep": "2x"}), "keep"),
        (_topk([0, 1, 0, 1], block=1 << 16), "keep|topk block_size"),
        (_topk([0, 1, 0, 1], extra={"shape:w": "2,x"}), "dense shape"),
        (_topk([0, 1, 0, 1], extra={"shape:w": "1," * 17 + "8"}), "dense shape"),
        (_topk([0, 1, 0, 1], extra={"shape:w": "8", "shape:v": "3"}), "malformed"),  # no such tensor
        (_topk([0, 1, 0, 1], extra={"shape:w": "65536,65536"}), "elements"),  # a small blob claiming 16 GB
    ],
)
def test_hostile_topk_blobs_are_codec_errors(data: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        parse(data)


def _int4(packed: int, elements: int, block: int = 4, scale_dtype: str = "F32") -> bytes:
    blocks = math.ceil(elements / block)
    body = struct.pack(f"<{blocks}f", *[1.0] * blocks) + bytes([0x88] * packed)
    header = {
        "__metadata__": {"codec": "int4", "block_size": str(block), "shape:w": str(elements)},
        "w:scale": {"dtype": scale_dtype, "shape": [blocks], "data_offsets": [0, 4 * blocks]},
        "w": {"dtype": "U8", "shape": [packed], "data_offsets": [4 * blocks, 4 * blocks + packed]},
    }
    return _blob(header, body)


def test_hostile_int4_blobs_are_codec_errors() -> None:
    assert decode(_int4(4, 7))[0]["w"].tolist() == [0.0] * 7
    with pytest.raises(CodecError, match="malformed"):
        parse(_int4(4, 9))  # 9 values need 5 bytes
    with pytest.raises(CodecError, match="malformed"):
        parse(_int4(4, 8, scale_dtype="I32"))
    with pytest.raises(CodecError, match="even"):
        parse(_int4(4, 8, block=3))
    bad = bytearray(_int4(4, 8))
    size = struct.unpack("<Q", bad[:8])[0]
    bad[8 + size : 8 + size + 4] = struct.pack("<f", math.inf)
    with pytest.raises(CodecError, match="non-finite"):
        parse(bytes(bad))


def test_random_corruption_of_lowbit_blobs_only_ever_raises_codec_error() -> None:
    rng = random.Random(3)
    tensors = {"a": torch.randn(300), "b": torch.arange(5), "c": torch.randn(4, 9)}
    blobs = [encode(tensors, codec, block, keep=keep) for codec, block, keep in CONFIGS]
    for _ in range(1500):
        data = bytearray(rng.choice(blobs))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data))
            if rng.random() < 0.7:
                data[pos] = rng.randrange(256)
            else:
                del data[pos : pos + rng.randint(1, 20)]
        with contextlib.suppress(CodecError):
            packed = parse(bytes(data))
            packed.decode()
            packed.select([name for name in packed if packed.is_float(name)]).sq_norm()


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(fixture_text())
    print(f"wrote {FIXTURE}")
