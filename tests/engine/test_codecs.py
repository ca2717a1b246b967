"""Codecs: exact/rounded round trips, the int8 block layout, validation and error feedback."""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.codecs import CodecError, ErrorFeedback, decode, encode


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fc1.weight": torch.randn(7, 100, generator=g) * 3,
        "fc1.bias": torch.randn(7, generator=g),
        "zeros": torch.zeros(300),
    }


def test_fp32_round_trip_is_exact_with_metadata() -> None:
    tensors = _tensors()
    out, meta = decode(encode(tensors, metadata={"round": "3"}))
    assert meta == {"codec": "fp32", "block_size": "256", "round": "3"}
    assert out.keys() == tensors.keys()
    assert all(torch.equal(out[k], v) and out[k].dtype == torch.float32 for k, v in tensors.items())


def test_fp16_round_trip_equals_half_precision_rounding() -> None:
    tensors = _tensors()
    data = encode(tensors, "fp16")
    assert all(t.dtype == torch.float16 for t in st_load(data).values())
    out, meta = decode(data)
    assert meta["codec"] == "fp16"
    for k, v in tensors.items():
        assert out[k].dtype == torch.float32 and torch.equal(out[k], v.half().float())


@pytest.mark.parametrize("block_size", [1, 64, 256, 1000])
def test_int8_layout_and_error_bound(block_size: int) -> None:
    tensors = _tensors()
    data = encode(tensors, "int8", block_size=block_size)
    raw = st_load(data)
    w = tensors["fc1.weight"]
    assert raw["fc1.weight"].dtype == torch.int8 and raw["fc1.weight"].shape == w.shape
    scales = raw["fc1.weight:scale"]
    assert scales.dtype == torch.float32 and scales.shape == (math.ceil(w.numel() / block_size),)
    # The documented meaning: value = int8 * scale of its block of the flattened tensor.
    manual = raw["fc1.weight"].reshape(-1).float() * scales.repeat_interleave(block_size)[: w.numel()]
    out, meta = decode(data)
    assert meta == {"codec": "int8", "block_size": str(block_size)}
    assert torch.equal(out["fc1.weight"], manual.reshape(w.shape))
    flat = w.reshape(-1)
    pad = (-flat.numel()) % block_size
    absmax = torch.cat([flat, flat.new_zeros(pad)]).abs().reshape(-1, block_size).amax(1)
    torch.testing.assert_close(scales, absmax / 127)
    bound = scales.repeat_interleave(block_size)[: flat.numel()] / 2 + 1e-6
    assert bool(((out["fc1.weight"].reshape(-1) - flat).abs() <= bound).all())
    assert torch.equal(out["zeros"], tensors["zeros"])


def test_integer_tensors_pass_through_every_codec() -> None:
    labels = np.arange(10, dtype=np.int32)
    tokens = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    for codec in ("fp32", "fp16", "int8"):
        out, _ = decode(encode({"y": labels, "ids": tokens, "x": np.ones(3, np.float32)}, codec))
        assert out["y"].dtype == torch.int32 and out["y"].tolist() == labels.tolist()
        assert out["ids"].dtype == torch.int64 and torch.equal(out["ids"], tokens)
        assert out["x"].dtype == torch.float32


def test_encode_rejects_unknown_codec_and_name_collisions() -> None:
    with pytest.raises(CodecError, match="unknown codec"):
        encode({"a": torch.ones(2)}, "int2")
    with pytest.raises(CodecError, match="collides"):
        encode({"a": torch.ones(2), "a:scale": torch.ones(1)}, "int8")


def _raw(tensors: dict[str, torch.Tensor], **meta: str) -> bytes:
    return bytes(st_save(tensors, metadata=meta))


GARBAGE = [
    b"",
    b"\x00" * 4,
    b"garbage that is not safetensors at all",
    struct.pack("<Q", 10**12) + b"{}",
    struct.pack("<Q", 2) + b"{[",
    pickle.dumps({"a": torch.ones(2)}),
    _raw({"a": torch.ones(2)})[:-3],
]


@pytest.mark.parametrize("data", GARBAGE)
def test_garbage_raises_codec_error(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode(data)


def test_decode_never_unpickles(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("decode must not unpickle")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(torch, "load", boom)
    with pytest.raises(CodecError):
        decode(pickle.dumps([1, 2, 3]))
    assert decode(encode(_tensors(), "int8"))[1]["codec"] == "int8"


q = torch.tensor([1, -2, 3], dtype=torch.int8)
INVALID = [
    ("unknown codec", _raw({"a": torch.ones(2)}, codec="zip", block_size="256"), "unknown codec"),
    ("missing scale", _raw({"a": q}, codec="int8", block_size="2"), "missing or malformed"),
    (
        "wrong scale count",
        _raw({"a": q, "a:scale": torch.ones(1)}, codec="int8", block_size="2"),
        "missing or malformed",
    ),
    (
        "nan scale",
        _raw({"a": q, "a:scale": torch.tensor([1.0, math.nan])}, codec="int8", block_size="2"),
        "non-finite",
    ),
    (
        "inf scale",
        _raw({"a": q, "a:scale": torch.tensor([math.inf])}, codec="int8", block_size="256"),
        "non-finite",
    ),
    ("bad block size", _raw({"a": q, "a:scale": torch.ones(1)}, codec="int8", block_size="-1"), "block_size"),
    ("int8 in fp32 blob", _raw({"a": q}, codec="fp32", block_size="256"), "int8 tensors"),
]


@pytest.mark.parametrize(("data", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_encodings_are_rejected(data: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode(data)


def test_valid_handwritten_int8_blob_decodes() -> None:
    data = _raw({"a": q, "a:scale": torch.tensor([0.5, 2.0])}, codec="int8", block_size="2")
    out, _ = decode(data)
    assert out["a"].tolist() == [0.5, -1.0, 6.0]
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    assert header["__metadata__"] == {"codec": "int8", "block_size": "2"}


def test_error_feedback_keeps_what_quantisation_lost() -> None:
    g = torch.Generator().manual_seed(0)
    feedback = ErrorFeedback("int8", block_size=64)
    updates = [{"w": torch.randn(500, generator=g) * 10 ** -(i % 3)} for i in range(20)]
    sent_total = torch.zeros(500)
    residual = torch.zeros(500)
    for update in updates:
        data = feedback.compress(update)
        sent = decode(data)[0]["w"]
        # residual = (update + previous residual) - what was sent
        torch.testing.assert_close(feedback.residual["w"], update["w"] + residual - sent)
        residual = feedback.residual["w"]
        sent_total += sent
    true_total = sum(u["w"] for u in updates)
    # Telescoping: everything not sent yet is exactly the current residual.
    torch.testing.assert_close(sent_total + feedback.residual["w"], true_total, atol=1e-4, rtol=1e-5)
    plain = sum(decode(encode(u, "int8", 64))[0]["w"] for u in updates)
    assert (sent_total - true_total).abs().max() <= (plain - true_total).abs().max()


def test_random_corruption_only_ever_raises_codec_error() -> None:
    import random

    rng = random.Random(0)
    blobs = [encode({"a": torch.randn(300), "b": torch.arange(5)}, c, 64) for c in ("fp32", "fp16", "int8")]
    for _ in range(1000):
        data = bytearray(rng.choice(blobs))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data))
            if rng.random() < 0.7:
                data[pos] = rng.randrange(256)
            else:
                del data[pos : pos + rng.randint(1, 20)]
        with contextlib.suppress(CodecError):
            decode(bytes(data))


# --- hostile headers (issue 9): bounded before parsing, and never anything but CodecError -------------

from engine.codecs import MAX_HEADER, check_header_length, json_depth, json_loads_bounded  # noqa: E402


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        (b"", 0),
        (b"{}", 1),
        (b'[1, [2, {"a": [3]}]]', 4),
        (b'{"a": "[[[[{{"}', 1),  # brackets inside strings do not count
        (rb'{"a": "\"[[["}', 1),  # nor after an escaped quote
        (rb'["\\", [[0]]]', 3),  # an escaped backslash does not escape the closing quote
        (rb'["\\\"[[", [0]]', 2),
        ("[[\u00e9]]", 2),
    ],
)
def test_json_depth_counts_nesting_outside_strings(text: bytes | str, depth: int) -> None:
    assert json_depth(text) == depth
    with contextlib.suppress(ValueError):  # where the text is JSON, json.loads agrees
        loaded = json.loads(text)
        assert _depth(loaded) == depth


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def test_json_depth_scans_across_chunks() -> None:
    text = b"[" * 5000 + b'"]]]' + b"]" * 5000
    assert json_depth(text, chunk=7) == json_depth(text) == 5000


def test_json_nesting_is_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed a too deeply nested text"))
    with pytest.raises(ValueError, match="nested 100,000 levels deep"):
        json_loads_bounded(b"[" * 100_000 + b"]" * 100_000)


def test_recursion_in_the_parser_is_a_value_error_too() -> None:
    # Should the scan ever let deep nesting through, the parser's RecursionError is still a ValueError.
    with pytest.raises(ValueError, match="nested too deeply"):
        json_loads_bounded(b"[" * 100_000 + b"]" * 100_000, max_depth=10**6)


HOSTILE_HEADERS = [
    ("the issue's frame", struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000, "nested"),
    ("objects nested deep", struct.pack("<Q", 60_000) + b'{"a":' * 10_000 + b"0" + b"}" * 10_000, "nested"),
    ("89.5 MB header", struct.pack("<Q", 89_500_000) + b"{}", "89,500,000 bytes"),
    ("2**64 - 1 header", struct.pack("<Q", 2**64 - 1) + b"{}", "at most"),
    ("header is a list", struct.pack("<Q", 2) + b"[]", "not an object"),
]


def _st(header: dict[str, object], body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _entry(dtype: object, shape: object, offsets: object) -> dict[str, object]:
    return {"w": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}


HOSTILE_ENTRIES = [
    ("shape of 4 TB in 4 bytes", _st(_entry("F32", [10**12, 1], [0, 4]), bytes(4)), "does not fit"),
    ("negative dimension", _st(_entry("F32", [-1, 4], [0, 16]), bytes(16)), "non-negative ints"),
    ("dimension 2**64", _st(_entry("F32", [2**64, 0], [0, 0]), b""), "non-negative ints"),
    ("float dimension", _st(_entry("F32", [2.0], [0, 8]), bytes(8)), "non-negative ints"),
    ("bool dimension", _st(_entry("F32", [True], [0, 4]), bytes(4)), "non-negative ints"),
    ("17 dimensions", _st(_entry("F32", [1] * 17, [0, 4]), bytes(4)), "at most 16"),
    ("offsets past the end", _st(_entry("F32", [2], [0, 2**40]), bytes(8)), "does not fit"),
    ("offsets reversed", _st(_entry("F32", [0], [8, 0]), bytes(8)), "does not fit"),
    ("one offset", _st(_entry("F32", [2], [8]), bytes(8)), "data_offsets"),
    ("offsets a string", _st(_entry("F32", [2], "0-8"), bytes(8)), "data_offsets"),
    ("unsupported dtype", _st(_entry("U64", [1], [0, 8]), bytes(8)), "unsupported dtype"),
    ("dtype not a string", _st(_entry(["F32"], [1], [0, 4]), bytes(4)), "unsupported dtype"),
    ("entry not an object", _st({"w": [1, 2]}, b""), "exactly dtype, shape and data_offsets"),
    (
        "extra key",
        _st({"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 4], "x": 1}}, bytes(4)),
        "exactly dtype",
    ),
    (
        "unicode digit block size",
        _st({"__metadata__": {"codec": "int8", "block_size": "²"}}, b""),
        "block_size",
    ),
    ("5,000 digit block size", _st({"__metadata__": {"block_size": "9" * 5000}}, b""), "block_size"),
    ("metadata not strings", _st({"__metadata__": {"codec": []}}, b""), "metadata"),
    (
        "too many tensors",
        _st({f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(10_001)}, b""),
        "10,001 tensors",
    ),
]


@pytest.mark.parametrize(
    ("data", "message"),
    [c[1:] for c in HOSTILE_HEADERS + HOSTILE_ENTRIES],
    ids=[c[0] for c in HOSTILE_HEADERS + HOSTILE_ENTRIES],
)
def test_hostile_headers_are_codec_errors(data: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode(data)


def test_header_length_bound_is_a_parameter() -> None:
    data = encode({"a": torch.ones(2)}, metadata={"pad": "p" * 1000})
    assert MAX_HEADER == 16 * 2**20 and decode(data)[0]["a"].tolist() == [1.0, 1.0]
    with pytest.raises(CodecError, match="at most 500"):
        decode(data, max_header=500)
    with pytest.raises(CodecError, match="at most 500"):
        check_header_length(data[:8], 500)


def test_a_huge_declared_header_is_refused_without_reading_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed a header over the limit"))
    data = struct.pack("<Q", MAX_HEADER + 1) + b" " * (MAX_HEADER + 1)
    with pytest.raises(CodecError, match="at most 16,777,216"):
        decode(data)


def test_random_hostile_headers_only_ever_raise_codec_error() -> None:
    """Seeded fuzz of headers: nesting, absurd numbers, wrong types, in every field."""
    import random

    rng = random.Random(9)
    junk: list[object] = [
        None,
        -1,
        0,
        2**31,
        2**63,
        2**64,
        10**30,
        1.5,
        "x",
        "",
        [],
        {},
        [0],
        [-1, 2],
        [2**64, 0],
        True,
        "F32",
        "I8",
        [0, 2**40],
    ]
    for _ in range(500):
        entry = {
            "dtype": rng.choice(junk + ["F32", "U8"] * 3),
            "shape": rng.choice(junk + [[2], [1, 2]] * 3),
            "data_offsets": rng.choice(junk + [[0, 8]] * 3),
        }
        header: dict[str, object] = {"w": rng.choice([entry, entry, rng.choice(junk)])}
        if rng.random() < 0.3:
            header["__metadata__"] = rng.choice(junk + [{"codec": rng.choice(junk)}])
        raw = json.dumps(header).encode()
        if rng.random() < 0.2:
            depth = rng.choice([33, 1000, 50_000])
            raw = b"[" * depth + b"]" * depth
        length = rng.choice([len(raw)] * 5 + [0, len(raw) + 1, 2**63, rng.randrange(2**64)])
        with contextlib.suppress(CodecError):
            decode(struct.pack("<Q", length) + raw + bytes(rng.choice([0, 8, 16])))


# --- parse: checked, not decoded (issue 15) ------------------------------------------------------------

from engine import codecs  # noqa: E402
from engine.codecs import encode_parts, parse  # noqa: E402


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors on both sides of codecs.SMALL (gathered together / a loop each), whole and partial blocks."""
    g = torch.Generator().manual_seed(seed)
    sizes = {"conv.weight": (40, 30, 3, 3), "fc.weight": (10, 1001), "bn.bias": (64,), "fc.bias": (10,)}
    return {name: torch.randn(shape, generator=g) * 0.1 for name, shape in sizes.items()}


@pytest.fixture(params=[1, 64, 256, 1000])
def blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    # Small chunks and a small SMALL, so that these tensors take every path: gathered, several chunks, a tail.
    monkeypatch.setattr(codecs, "CHUNK", 4096)
    monkeypatch.setattr(codecs, "SMALL", 2000)
    return int(request.param)


def test_parse_maps_tensors_and_decodes_them_on_access(blocks: int) -> None:
    tensors = {**_model(), "ids": torch.arange(7)}
    data = encode(tensors, "int8", block_size=blocks)
    packed = parse(data)
    decoded, meta = decode(data)
    assert set(packed) == set(tensors) and len(packed) == 5 and "ids" in packed and "x" not in packed
    assert packed.meta == meta == {"codec": "int8", "block_size": str(blocks)}
    assert packed.shape("fc.weight") == (10, 1001) and packed.dtype("fc.weight") == torch.int8
    assert packed.is_float("fc.weight") and not packed.is_float("ids")
    assert all(torch.equal(packed[name], decoded[name]) for name in tensors)
    assert all(torch.equal(value, decoded[name]) for name, value in packed.decode().items())
    assert set(packed.select(["bn.bias", "ids"])) == {"bn.bias", "ids"}
    with pytest.raises(KeyError):
        packed.select(["nope"])


def test_the_norm_and_the_fold_equal_the_decoded_arithmetic(blocks: int) -> None:
    """sq_norm and add_to read the int8 values without decoding: the same numbers as decoding first."""
    for codec in ("int8", "fp16", "fp32"):
        packed = parse(encode(_model(1), codec, block_size=blocks))
        decoded = packed.decode()
        exact = sum(float((t.double() ** 2).sum()) for t in decoded.values())
        assert math.isclose(packed.sq_norm(), exact, rel_tol=1e-6)
        sums = {name: torch.full(t.shape, 0.5) for name, t in decoded.items()}
        packed.add_to(sums, 0.3)
        for name, value in decoded.items():
            torch.testing.assert_close(sums[name], 0.5 + 0.3 * value, rtol=1e-6, atol=1e-7)


def test_fold_refuses_a_sum_of_another_shape() -> None:
    packed = parse(encode({"w": torch.ones(3, 4)}, "int8"))
    with pytest.raises(ValueError, match="shape"):
        packed.add_to({"w": torch.zeros(4, 3)}, 1.0)


def test_finite_looks_at_the_values_only_when_a_scale_could_overflow() -> None:
    """int8 * a finite scale overflows float32 only for scales near its maximum: then each value counts."""
    big = torch.tensor([3e38], dtype=torch.float32)
    overflow = _raw(
        {"a": torch.tensor([127, 0], dtype=torch.int8), "a:scale": big}, codec="int8", block_size="2"
    )
    fine = _raw({"a": torch.tensor([1, 0], dtype=torch.int8), "a:scale": big}, codec="int8", block_size="2")
    usual = encode({"a": torch.randn(300)}, "int8")
    for data in (overflow, fine, usual):
        assert parse(data).finite("a") == bool(torch.isfinite(decode(data)[0]["a"]).all())
    assert not parse(overflow).finite("a") and parse(fine).finite("a")


def test_encoding_is_deterministic_and_its_pieces_are_the_bytes() -> None:
    tensors = {**_model(), "ids": torch.arange(5, dtype=torch.int32)}
    for codec in ("fp32", "fp16", "int8"):
        data = encode(tensors, codec, metadata={"b": "2", "a": "1", "z": "3"})
        assert b"".join(encode_parts(tensors, codec, metadata={"z": "3", "a": "1", "b": "2"})) == data
        # safetensors' own reader and writer agree: the same tensors either way.
        again = _raw(dict(st_load(data)), **decode(data)[1])
        assert all(torch.equal(v, decode(again)[0][k]) for k, v in decode(data)[0].items())
    assert all(torch.equal(st_load(encode(tensors))[k], v) for k, v in tensors.items())
    # The header is padded to 8 bytes and wider elements come first: every tensor is aligned in the file.
    data = encode(tensors, "int8")
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    entries = [info for name, info in header.items() if name != "__metadata__"]
    assert size % 8 == 0
    assert all(e["data_offsets"][0] % {"F32": 4, "I32": 4, "I8": 1}[e["dtype"]] == 0 for e in entries)


def test_encoding_refuses_what_decoding_cannot_read() -> None:
    with pytest.raises(CodecError, match="cannot encode"):
        encode({"a": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(CodecError, match="metadata"):
        encode({"__metadata__": torch.ones(2)})


LAYOUTS = [
    ("overlapping tensors", {"a": ("F32", [2], [0, 8]), "b": ("F32", [2], [4, 12])}, 12, "overlaps"),
    ("a gap", {"a": ("F32", [1], [0, 4]), "b": ("F32", [1], [8, 12])}, 12, "gap"),
    ("bytes after the tensors", {"a": ("F32", [1], [0, 4])}, 8, "ends at byte 4"),
]


@pytest.mark.parametrize(
    ("entries", "size", "message"), [c[1:] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS]
)
def test_tensor_data_must_tile_the_buffer(
    entries: dict[str, tuple[str, list[int], list[int]]], size: int, message: str
) -> None:
    header: dict[str, object] = {
        n: {"dtype": d, "shape": s, "data_offsets": o} for n, (d, s, o) in entries.items()
    }
    with pytest.raises(CodecError, match=message):
        decode(_st(header, bytes(size)))


def test_misaligned_tensors_are_read_from_an_aligned_copy() -> None:
    """No encoder of ours writes them, but a hand-made blob may: the values still come out right."""
    values = torch.tensor([1.5, -2.0, 3.25])
    header = {
        "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "a": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 4)  # the data starts 4-aligned, so "a" (1 byte in) is not
    data = struct.pack("<Q", len(raw)) + raw + b"\x07" + values.numpy().tobytes()
    out = decode(data)[0]
    assert torch.equal(out["a"], values) and out["b"].tolist() == [7]


def test_decode_without_copies_gives_views_of_a_writable_buffer() -> None:
    buffer = bytearray(encode({"w": torch.zeros(4), "n": torch.arange(3)}))
    shared = decode(buffer, copy=False)[0]
    shared["w"].add_(1.0)
    assert decode(bytes(buffer))[0]["w"].tolist() == [1.0] * 4  # the buffer itself changed
    owned = decode(buffer)[0]
    owned["w"].add_(1.0)
    assert decode(bytes(buffer))[0]["w"].tolist() == [1.0] * 4


def test_a_header_is_checked_once_per_process_and_a_refused_one_every_time() -> None:
    data = encode(_model(), "int8")
    parse(data)
    hits = codecs._cached_layout.cache_info().hits
    parse(encode(_model(2), "int8"))  # another update of the same model: the same header
    assert codecs._cached_layout.cache_info().hits == hits + 1
    bad = _raw({"a": q, "a:scale": torch.tensor([math.nan, 1.0])}, codec="int8", block_size="2")
    for _ in range(2):
        with pytest.raises(CodecError, match="non-finite"):
            parse(bad)


def test_quantizing_a_chunk_at_a_time_gives_the_padded_formulas_bits(blocks: int) -> None:
    """The browser's encoder (tests/browser/test_codecs.py) and this one agree on the simple definition."""
    x = torch.randn(12_345, generator=torch.Generator().manual_seed(3))
    x[100:700] = 0.0  # all-zero blocks keep scale 0
    padded = torch.cat([x, x.new_zeros((-x.numel()) % blocks)]).view(-1, blocks)
    scale = padded.abs().amax(dim=1) / 127.0
    q = torch.round(padded / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127)
    got_q, got_scale = codecs.quantize_int8(x, blocks)
    assert torch.equal(got_scale, scale)
    assert torch.equal(got_q, q.to(torch.int8).reshape(-1)[: x.numel()])


def test_a_header_built_once_per_layout_follows_new_shapes_dtypes_and_metadata() -> None:
    """Headers are built once per names, dtypes and shapes (and metadata): tensors under the same names
    with other shapes or dtypes, or other metadata, get their own."""
    first = {"w": torch.randn(3, 4), "n": torch.tensor([1], dtype=torch.int64)}
    reshaped = {"w": torch.randn(4, 3), "n": torch.tensor([1], dtype=torch.int64)}
    retyped = {"w": torch.randn(3, 4), "n": torch.tensor([1], dtype=torch.int32)}
    for tensors in (first, reshaped, retyped, first):
        decoded, _ = decode(encode(tensors))
        assert {k: (v.dtype, v.shape) for k, v in decoded.items()} == {
            k: (v.dtype, v.shape) for k, v in tensors.items()
        }
        assert all(torch.equal(decoded[k], v) for k, v in tensors.items())
    assert decode(encode(first, metadata={"step": "2"}))[1]["step"] == "2"


def test_encode_fp32_named_is_encode_parts_in_named_pieces_of_the_tensors_own_memory() -> None:
    """The publish step hashes each tensor once stepped: the pieces must be the blob's bytes in order,
    and the tensors' memory itself (a change to a tensor is a change to its piece)."""
    from engine.codecs import encode_fp32_named, encode_parts

    tensors = {"w": torch.randn(3, 4), "b": torch.randn(4), "steps": torch.tensor([3], dtype=torch.int64)}
    header, named = encode_fp32_named(tensors)
    assert header.tobytes() + b"".join(p.tobytes() for _, p in named) == encode(tensors)
    assert b"".join(bytes(p) for p in encode_parts(tensors)) == encode(tensors)
    tensors["w"].add_(1.0)
    assert dict(named)["w"].tobytes() == tensors["w"].numpy().tobytes()
    with pytest.raises(CodecError, match="float32"):
        encode_fp32_named({"h": torch.randn(2).half()})
    with pytest.raises(CodecError, match="contiguous"):
        encode_fp32_named({"t": torch.randn(3, 4).t()})
