"""Reading the logs of processes run on the bed: a `prefix:` line a daemon prints, and a
worker's `--log-json` events. Shared by the netlab benchmarks; stdlib only."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def wait_line(path: Path, prefix: str, timeout_s: float) -> str:
    """The rest of the first line of `path` that starts with `prefix`, waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
        time.sleep(0.2)
    tail = path.read_text()[-2000:] if path.exists() else "(no file)"
    raise RuntimeError(f"no {prefix!r} line in {path} within {timeout_s} s:\n{tail}")


def events(path: Path, kind: str) -> list[dict[str, Any]]:
    """Every JSON event of `kind` in a worker's log (other lines, and a missing file, give none)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") == kind:
                out.append(rec)
    return out
