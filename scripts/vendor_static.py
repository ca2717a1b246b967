#!/usr/bin/env python3
"""Copy the browser's third-party files from node_modules into frontend/vendor/.

They are served at /static/vendor/... . frontend/vendor is gitignored: vendored third-party code is
never committed, so run this at set-up (after `npm ci`). Plain Python, no Django.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE = ROOT / "node_modules"
VENDOR = ROOT / "frontend" / "vendor"

WASM_DIST = "@tensorflow/tfjs-backend-wasm/dist"

# (source under node_modules, file name in frontend/vendor)
FILES = [
    ("@tensorflow/tfjs/dist/tf.min.js", "tf.min.js"),
    (f"{WASM_DIST}/tf-backend-wasm.min.js", "tf-backend-wasm.min.js"),
    # The wasm backend fetches its binaries next to its script unless told otherwise.
    (f"{WASM_DIST}/tfjs-backend-wasm.wasm", "tfjs-backend-wasm.wasm"),
    (f"{WASM_DIST}/tfjs-backend-wasm-simd.wasm", "tfjs-backend-wasm-simd.wasm"),
    (f"{WASM_DIST}/tfjs-backend-wasm-threaded-simd.wasm", "tfjs-backend-wasm-threaded-simd.wasm"),
    ("@tensorflow/tfjs-backend-webgpu/dist/tf-backend-webgpu.min.js", "tf-backend-webgpu.min.js"),
    ("chart.js/dist/chart.umd.min.js", "chart.umd.min.js"),
    # /api/docs/ (drf-spectacular's Swagger UI page, SPECTACULAR_SETTINGS["SWAGGER_UI_DIST"]).
    ("swagger-ui-dist/swagger-ui.css", "swagger-ui/swagger-ui.css"),
    ("swagger-ui-dist/swagger-ui-bundle.js", "swagger-ui/swagger-ui-bundle.js"),
    ("swagger-ui-dist/swagger-ui-standalone-preset.js", "swagger-ui/swagger-ui-standalone-preset.js"),
    ("swagger-ui-dist/favicon-32x32.png", "swagger-ui/favicon-32x32.png"),
]


def main() -> int:
    missing = [src for src, _ in FILES if not (NODE / src).is_file()]
    if missing:
        print("missing in node_modules (run `npm ci`):", *missing, sep="\n  ", file=sys.stderr)
        return 1
    VENDOR.mkdir(parents=True, exist_ok=True)
    for src, dst in FILES:
        (VENDOR / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(NODE / src, VENDOR / dst)
        print(f"{src} -> {(VENDOR / dst).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
