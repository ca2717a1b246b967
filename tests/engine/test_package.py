"""The engine is plain Python + torch: importing all of it must not pull in Django."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_never_imports_django() -> None:
    code = (
        "import sys\n"
        "import engine, engine.graph, engine.ops, engine.runtime, engine.flops, engine.codecs\n"
        "import engine.aggregate, engine.optim, engine.presets, engine.export\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework', "
        "'channels', 'config', 'projects', 'workers'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
