"""engine/spec.json, the one source of the facts the server and the browsers share, and its browser copy."""

from __future__ import annotations

import json
from typing import Any

from engine import spec


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys in engine/spec.json: {keys}"
    return dict(pairs)


def test_the_spec_file_names_each_fact_once() -> None:
    # json.loads keeps the last of two equal keys: a second "conv2d" entry would silently win.
    json.loads(spec.SPEC_PATH.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicates)


def test_the_browsers_copy_is_current() -> None:
    assert spec.JS_PATH.read_text(encoding="utf-8") == spec.js_source(), "run `python -m engine.spec`"


def test_every_slot_is_plain_optional_or_a_final_variadic() -> None:
    for op, raw in spec.GRAPH["ops"].items():
        slots = raw["inputs"]
        assert slots and all(slot.rstrip("?*").isidentifier() for slot in slots), op
        assert all(not slot.endswith("*") for slot in slots[:-1]), op
