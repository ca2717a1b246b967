"""Hostile uploads for the admin's forms (issue 9, item 4): .npz datasets, graph.json and safetensors
weights, each crafted to reach a 500 or exhaust memory, and a seeded random generator of many more.

Everything is built by hand (raw .npy headers, raw zip bytes, raw safetensors headers) so that a file may
lie in every way a hostile researcher account could make it lie. Used by tests/security/test_uploads.py
(a few hundred cases) and benchmarks/security/uploads.py (thousands, with memory measured).
"""

from __future__ import annotations

import io
import json
import random
import struct
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# What each upload goes to: the dataset form's `file`, or the project form's graph_file / weights_file.
NPZ, GRAPH, WEIGHTS = "npz", "graph", "weights"

# Dimensions that break naive code: negative, zero, int32/int64 edges, and far beyond memory.
DIMS = [-1, 0, 1, 2, 3, 7, 2**31 - 1, 2**31, 10**12, 2**63 - 1, 2**63, 2**64 + 1]
DESCRS = [
    "<f4",
    "<f8",
    "|u1",
    "<i8",
    "|O",
    "<U10",
    "|V8",
    "<c8",
    ">f4",
    "|b1",
    "<f2",
    "<M8[s]",
    "[('a', '<f4')]",
    "('<f4', (2147483647, 2147483647))",
    "'<f4'",
    "None",
    "1e400",
]
ST_DTYPES: list[Any] = [
    "F32",
    "F16",
    "BF16",
    "F64",
    "I8",
    "I16",
    "I32",
    "I64",
    "U8",
    "BOOL",
    "U64",
    "F8_E4M3",
    "C64",
    "",
    "f32",
    None,
    3,
    [],
]


@dataclass(frozen=True)
class Upload:
    kind: str  # NPZ | GRAPH | WEIGHTS
    name: str
    data: bytes


# --- .npy / .npz ------------------------------------------------------------------------------------


def npy_header(shape: str, descr: str = "'<f4'", fortran: str = "False", version: int = 1) -> bytes:
    """A raw .npy header whose fields are given as Python literals, so they can be anything at all."""
    text = f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, }}"
    size_format = "<H" if version == 1 else "<I"
    prefix = 8 + struct.calcsize(size_format)
    pad = -(prefix + len(text) + 1) % 64
    body = (text + " " * pad + "\n").encode("latin1")
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack(size_format, len(body)) + body


def npy(shape: tuple[int, ...], descr: str = "<f4", data: bytes = b"") -> bytes:
    return npy_header(repr(tuple(shape)), repr(descr)) + data


def npy_array(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def zip_of(members: list[tuple[str, bytes]], compress: bool = False) -> bytes:
    buffer = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(buffer, "w", method) as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are the point of some cases
        for name, payload in members:
            archive.writestr(name, payload)
    return buffer.getvalue()


def labels(n: int) -> bytes:
    return npy_array(np.arange(n) % 2)


def valid_npz(samples: int = 20, features: int = 4, seed: int = 0) -> bytes:
    x = np.random.default_rng(seed).random((samples, features), dtype=np.float32)
    return zip_of([("x.npy", npy_array(x)), ("y.npy", labels(samples))])


def huge_shape_npz(shape: tuple[int, ...] = (10**12, 1)) -> bytes:
    """The issue's case: a header declaring 4 TB of float32 followed by a few bytes."""
    return zip_of([("x.npy", npy(shape, data=b"\0" * 16)), ("y.npy", labels(4))])


def zip_bomb(declared: int, chunk: int = 1 << 20) -> bytes:
    """A well-formed x.npy of `declared` zero bytes (uint8 samples of 1,000 features), deflated: about 1 KB
    per MB. Streamed, so building a gigabyte bomb never holds it in memory."""
    features = 1000
    samples = max(1, declared // features)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as member:
            member.write(npy((samples, features), "|u1"))
            left = samples * features
            zeros = bytes(min(chunk, left))
            while left > 0:
                member.write(zeros[: min(chunk, left)])
                left -= min(chunk, left)
        archive.writestr("y.npy", labels(samples)[:4096])
    return buffer.getvalue()


def lying_directory(real: bytes, member: str, declared: int) -> bytes:
    """`real` (a zip without zip64 records) with the central directory's uncompressed size of `member`
    replaced: the directory claims one size, the compressed stream inflates to another."""
    data = bytearray(real)
    offset = 0
    while True:
        start = data.find(b"PK\x01\x02", offset)
        if start < 0:
            return bytes(data)
        name_len = struct.unpack_from("<H", data, start + 28)[0]
        if data[start + 46 : start + 46 + name_len] == member.encode():
            struct.pack_into("<I", data, start + 24, declared & 0xFFFFFFFF)
        offset = start + 4


# --- graph.json ---------------------------------------------------------------------------------------


def nested_json(depth: int, opener: str = "[") -> bytes:
    closer = {"[": "]", "{": "}"}[opener]
    inner = '{"a":' * depth + "0" + "}" * depth if opener == "{" else opener * depth + closer * depth
    return inner.encode()


def graph_with(extra: Any) -> bytes:
    """A graph header followed by an extra field holding `extra` (raw JSON text)."""
    return b'{"format": "crowdtrain.graph", "version": 1, "extra": ' + extra + b"}"


def mlp_graph(features: int = 4, classes: int = 2) -> dict[str, Any]:
    return {
        "format": "crowdtrain.graph",
        "version": 1,
        "name": "tiny",
        "inputs": [{"name": "x", "shape": [-1, features], "dtype": "float32"}],
        "targets": [{"name": "y", "shape": [-1], "dtype": "int64"}],
        "params": [{"name": "w", "shape": [classes, features], "dtype": "float32"}],
        "buffers": [],
        "nodes": [{"name": "out", "op": "linear", "inputs": ["x", "w", None], "attrs": {}}],
        "output": "out",
        "loss": {"op": "cross_entropy", "inputs": ["out", "y"], "attrs": {}},
    }


def activation_bomb(features: int = 784, side: int = 784, classes: int = 10) -> dict[str, Any]:
    """The issue's case: ~0.6M parameters, but a matmul chain to [B, features * side, features * side]
    (1.5 TB per sample for 784 and 784) before two splits shrink it back to [B, classes]."""
    wide = features * side
    nodes = [
        {"name": "col", "op": "reshape", "inputs": ["x"], "attrs": {"shape": [-1, features, 1]}},
        {"name": "square", "op": "matmul", "inputs": ["col", "a"], "attrs": {}},
        {"name": "flat", "op": "reshape", "inputs": ["square"], "attrs": {"shape": [-1, wide, 1]}},
        {"name": "outer", "op": "matmul", "inputs": ["flat", "b"], "attrs": {}},
        {"name": "row", "op": "split", "inputs": ["outer"], "attrs": {"dim": 1, "start": 0, "length": 1}},
        {"name": "few", "op": "split", "inputs": ["row"], "attrs": {"dim": 2, "start": 0, "length": classes}},
        {"name": "logits", "op": "reshape", "inputs": ["few"], "attrs": {"shape": [-1, classes]}},
    ]
    graph = mlp_graph(features, classes)
    graph["params"] = [
        {"name": "a", "shape": [1, side], "dtype": "float32"},
        {"name": "b", "shape": [1, wide], "dtype": "float32"},
    ]
    graph.update(nodes=nodes, output="logits", loss={"op": "cross_entropy", "inputs": ["logits", "y"]})
    return graph


# --- safetensors ----------------------------------------------------------------------------------------


def safetensors(header: bytes, body: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + body


def st_entry(dtype: Any, shape: Any, offsets: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def weights_for(graph: dict[str, Any]) -> bytes:
    """Valid fp32 safetensors (zeros) for the graph's params, built by hand."""
    header: dict[str, Any] = {"__metadata__": {"codec": "fp32", "block_size": "256"}}
    offset = 0
    for spec in graph["params"]:
        size = 4 * int(np.prod(spec["shape"]))
        header[spec["name"]] = st_entry("F32", spec["shape"], [offset, offset + size])
        offset += size
    return safetensors(json.dumps(header).encode(), bytes(offset))


# --- the seeded random generator --------------------------------------------------------------------------


def _random_shape(rng: random.Random) -> str:
    if rng.random() < 0.1:
        depth = rng.choice([3, 50, 300, 5000])
        return "(" * depth + "1," + ")" * depth
    dims = [rng.choice(DIMS) for _ in range(rng.randint(0, 6))]
    return repr(tuple(dims)) if rng.random() < 0.9 else repr(dims)


def random_npz(rng: random.Random) -> bytes:
    choice = rng.randrange(8)
    if choice == 0:  # a header of random fields, a little data or none
        header = npy_header(
            _random_shape(rng),
            rng.choice(DESCRS),
            rng.choice(["False", "True", "1", "'x'"]),
            rng.choice([1, 1, 2, 3]),
        )
        return zip_of([("x.npy", header + bytes(rng.choice([0, 4, 16, 4096]))), ("y.npy", labels(4))])
    if choice == 1:  # a compression bomb of a random ratio and size
        return zip_bomb(rng.choice([1, 4, 16, 40, 70]) * 2**20)
    if choice == 2:  # the directory lies about the inflated size
        real = zip_of([("x.npy", npy_array(np.zeros((4096, 4), np.float32))), ("y.npy", labels(4096))], True)
        return lying_directory(real, "x.npy", rng.choice([0, 100, 2**20, 2**32 - 1]))
    if choice == 3:  # random member names, duplicates, many members
        names = [
            rng.choice(["x.npy", "y.npy", "x", "../x.npy", "x_test.npy", "a/b.npy", "z" * 300])
            for _ in range(rng.choice([1, 2, 3, 5, 40]))
        ]
        return zip_of([(name, valid_npz_member(rng)) for name in names], rng.random() < 0.5)
    if choice == 4:  # byte flips near the start (zip and .npy headers)
        return _flip(rng, valid_npz(seed=rng.randrange(10**6)), 200, rng.randint(1, 8))
    if choice == 5:  # truncated anywhere
        data = valid_npz(seed=rng.randrange(10**6))
        return data[: rng.randrange(len(data))]
    if choice == 6:  # the shape with random companions
        return huge_shape_npz(tuple(rng.choice(DIMS[4:]) for _ in range(rng.randint(1, 3))))
    return _flip(rng, valid_npz(seed=rng.randrange(10**6)), 10**9, rng.randint(1, 4))


def valid_npz_member(rng: random.Random) -> bytes:
    return npy_array(np.zeros((rng.randint(0, 5), 4), np.float32))


def random_graph(rng: random.Random) -> bytes:
    choice = rng.randrange(6)
    if choice == 0:
        return nested_json(rng.choice([40, 1000, 50_000, 300_000]), rng.choice("[{"))
    if choice == 1:
        return graph_with(nested_json(rng.choice([40, 990, 20_000]), rng.choice("[{")))
    if choice == 2:
        side = rng.choice([200, 784, 4096, 46341])
        return json.dumps(activation_bomb(features=4, side=side, classes=2)).encode()
    if choice == 3:  # absurd numbers where ints are expected
        graph = mlp_graph()
        graph["params"][0]["shape"] = [rng.choice(DIMS), rng.choice([4, 2**40, 10**400])]
        return json.dumps(graph).encode().replace(b"Infinity", b"1e400")
    if choice == 4:
        return _flip(rng, json.dumps(mlp_graph()).encode(), 10**9, rng.randint(1, 6))
    return rng.choice([b"", b"null", b"1e99999", b"9" * 5000, b'"\\ud800"', b"\xff\xfe[", b"[" * 10 + b"]"])


def random_weights(rng: random.Random) -> bytes:
    choice = rng.randrange(6)
    graph = mlp_graph()
    if choice == 0:  # the length field itself
        valid = weights_for(graph)
        return struct.pack("<Q", rng.choice([0, 1, 7, 2**24 + 1, 89_500_000, 2**63, 2**64 - 1])) + valid[8:]
    if choice == 1:
        return safetensors(nested_json(rng.choice([40, 500, 100_000]), rng.choice("[{")))
    if choice == 2:  # random entries: dtype, shape and offsets
        shape = [rng.choice(DIMS) for _ in range(rng.randint(0, 4))]
        offsets = rng.choice([[0, 32], [0, 2**64], [-4, 28], [32, 0], [0], "x", [0, 10**12]])
        header = {"w": st_entry(rng.choice(ST_DTYPES), shape, offsets)}
        return safetensors(json.dumps(header).encode(), bytes(32))
    if choice == 3:
        return _flip(rng, weights_for(graph), 120, rng.randint(1, 6))
    if choice == 4:  # bad metadata
        meta: Any = rng.choice(
            [
                {"codec": "int8", "block_size": "²"},
                {"codec": []},
                {"block_size": "9" * 5000},
                {"codec": "int8", "block_size": "0"},
                "x",
                {"codec": "fp64"},
            ]
        )
        header = {"__metadata__": meta, "w": st_entry("F32", [2, 4], [0, 32])}
        return safetensors(json.dumps(header).encode(), bytes(32))
    data = weights_for(graph)
    return data[: rng.randrange(len(data))]


def _flip(rng: random.Random, data: bytes, within: int, count: int) -> bytes:
    out = bytearray(data)
    for _ in range(count):
        out[rng.randrange(min(within, len(out)))] = rng.randrange(256)
    return bytes(out)


GENERATORS: dict[str, Callable[[random.Random], bytes]] = {
    NPZ: random_npz,
    GRAPH: random_graph,
    WEIGHTS: random_weights,
}


def random_uploads(seed: int, count: int) -> list[Upload]:
    rng = random.Random(seed)
    kinds = list(GENERATORS)
    out = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        out.append(Upload(kind, f"fuzz-{seed}-{index}", GENERATORS[kind](rng)))
    return out
