"""The facts the server and the browsers share, from one file: engine/spec.json.

``graph``: the graph format's ops (input slots in order, a trailing "?" marking an optional, nullable input
and "*" a variadic one; attrs with their kind and, unless required, their default), losses, dtypes and
limits. ``protocol``: the volunteer protocol's version, in-flight bound, message types, limits and close
codes (docs/protocol.md).

The browsers read the same file as frontend/static/engine/spec.js, a classic script this module writes:
after editing spec.json run ``python -m engine.spec``. tests/js/shared_facts.test.mjs fails while that copy
is stale, and checks the browser engine's own tables against it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SPEC_PATH = Path(__file__).with_name("spec.json")
JS_PATH = Path(__file__).resolve().parent.parent / "frontend" / "static" / "engine" / "spec.js"

SPEC: dict[str, Any] = json.loads(SPEC_PATH.read_text(encoding="utf-8"))
GRAPH: dict[str, Any] = SPEC["graph"]
PROTOCOL: dict[str, Any] = SPEC["protocol"]

PROTOCOL_VERSION: int = PROTOCOL["version"]
MAX_IN_FLIGHT: int = PROTOCOL["max_in_flight"]

JS_HEADER = """\
// Generated from engine/spec.json by `python -m engine.spec`: edit that file, not this one.
// The facts the server and the browsers share (op table, graph limits, protocol constants).
// Classic script: attaches to self.crowdtrain.spec; load it before graph.js and runtime.js.
"""


def js_source() -> str:
    """The text of frontend/static/engine/spec.js."""
    body = json.dumps(SPEC, indent=2, allow_nan=False)
    return f"{JS_HEADER}(self.crowdtrain = self.crowdtrain || {{}}).spec = Object.freeze({body});\n"


def main() -> int:
    JS_PATH.write_text(js_source(), encoding="utf-8")
    print(f"wrote {JS_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
