"""What a volunteer sees: a live progress panel, plain lines, JSON lines, or nothing.

The agent reports two kinds of things here: *events* (registered, synced, round committed,
coordinator unreachable, ...) and *progress* fields that change many times a second (inner
step, loss, samples/s, exchange and checkpoint bytes apart, time to the deadline). Modes:

- `rich`  — a live panel (rich.live) with the progress fields, events printed above it;
  used when stdout is a terminal.
- `plain` — one line per event plus a progress line at most every few seconds; used
  when stdout is not a terminal (logs, the demo's subprocesses).
- `json`  — `--log-json`: one JSON object per line for every event and every inner step,
  `{"ts": unix_s, "event": name, ...fields}`, for scripts and tests.
- `quiet` — `--quiet`: warnings and errors only, on stderr.

Thread-safe: progress arrives from the training thread, events from the event loop.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from typing import IO, Any

_FIELDS = (
    "worker",
    "phase",
    "cell",
    "round",
    "step",
    "steps",
    "loss",
    "samples_per_s",
    "exchange_sent",  # pseudo-gradient exchange bytes
    "exchange_received",
    "checkpoint_sent",  # state moved whole: checkpoint uploads, syncs from a donor or the coordinator
    "checkpoint_received",
    "deadline_unix_ms",
    "committed",
)
_PLAIN_PROGRESS_EVERY_S = 5.0


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Display:
    """Progress and event sink; `mode` is one of rich, plain, json, quiet (or auto)."""

    def __init__(self, mode: str = "auto", stream: IO[str] | None = None, err: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout
        self.err = err or sys.stderr
        if mode == "auto":
            mode = "rich" if getattr(self.stream, "isatty", lambda: False)() else "plain"
        if mode not in ("rich", "plain", "json", "quiet"):
            raise ValueError(f"unknown display mode {mode!r}")
        self.mode = mode
        self.fields: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._last_plain = 0.0
        self._live: Any = None
        self._console: Any = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self.mode != "rich":
            return
        from rich.console import Console
        from rich.live import Live

        self._console = Console(file=self.stream)
        self._live = Live(self._render(), console=self._console, refresh_per_second=4, transient=False)
        self._live.start()

    def stop(self) -> None:
        with self._lock:
            if self._live is not None:
                self._live.update(self._render())
                self._live.stop()
                self._live = None

    # ------------------------------------------------------------------ input

    def event(self, name: str, level: str = "info", **fields: Any) -> None:
        """A discrete happening; `level` is info, warning or error."""
        with self._lock:
            if self.mode == "json":
                rec = {"ts": round(time.time(), 3), "event": name, "level": level}
                rec.update({k: _jsonable(v) for k, v in fields.items()})
                self.stream.write(json.dumps(rec, default=str) + "\n")
                self.stream.flush()
                return
            text = self._format_event(name, fields)
            if self.mode == "quiet":
                if level != "info":
                    self.err.write(f"{level}: {text}\n")
                    self.err.flush()
                return
            if self.mode == "rich" and self._console is not None:
                style = {"warning": "yellow", "error": "bold red"}.get(level, "")
                self._console.print(
                    f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}", style=style or None, markup=True, highlight=False
                )
                return
            prefix = "" if level == "info" else f"{level}: "
            self.stream.write(f"{time.strftime('%H:%M:%S')} {prefix}{text}\n")
            self.stream.flush()

    def update(self, **fields: Any) -> None:
        """Change progress fields (cell, round, step, loss, samples_per_s, bytes, deadline...)."""
        with self._lock:
            self.fields.update(fields)
            if self.mode == "json":
                if "step" in fields:
                    rec = {"ts": round(time.time(), 3), "event": "step", "level": "info"}
                    rec.update({k: _jsonable(v) for k, v in self.fields.items()})
                    self.stream.write(json.dumps(rec, default=str) + "\n")
                    self.stream.flush()
            elif self.mode == "rich" and self._live is not None:
                self._live.update(self._render())
            elif self.mode == "plain":
                now = time.monotonic()
                if "step" in fields and now - self._last_plain >= _PLAIN_PROGRESS_EVERY_S:
                    self._last_plain = now
                    self.stream.write(f"{time.strftime('%H:%M:%S')} {self.progress_line()}\n")
                    self.stream.flush()

    # ------------------------------------------------------------------ rendering

    def progress_line(self) -> str:
        f = self.fields
        parts = [f"{f.get('phase', '-')}"]
        if f.get("cell"):
            parts.append(f"cell {f['cell']} round {f.get('round', '-')}")
        if f.get("steps"):
            parts.append(f"step {f.get('step', 0)}/{f['steps']}")
        if isinstance(f.get("loss"), float) and math.isfinite(f["loss"]):
            parts.append(f"loss {f['loss']:.4f}")
        if f.get("samples_per_s"):
            parts.append(f"{f['samples_per_s']:.0f} samples/s")
        parts.append(
            f"exchange sent {human_bytes(f.get('exchange_sent', 0))} recv {human_bytes(f.get('exchange_received', 0))}"
        )
        up, down = human_bytes(f.get("checkpoint_sent", 0)), human_bytes(f.get("checkpoint_received", 0))
        parts.append(f"checkpoints up {up} down {down}")
        left = self.deadline_left_s()
        if left is not None:
            parts.append(f"deadline in {left:.0f}s")
        return " | ".join(parts)

    def deadline_left_s(self) -> float | None:
        d = self.fields.get("deadline_unix_ms")
        if not d:
            return None
        return max(0.0, d / 1000.0 - time.time())

    def _render(self) -> Any:
        from rich.table import Table

        f = self.fields
        t = Table(show_header=False, box=None, padding=(0, 1), title="bagel-worker", title_justify="left")
        t.add_column(style="bold cyan")
        t.add_column()
        t.add_row("worker", str(f.get("worker", "-")))
        t.add_row("phase", str(f.get("phase", "-")))
        t.add_row(
            "cell / round", f"{f.get('cell') or '-'} / {f.get('round', '-')}  (committed {f.get('committed', '-')})"
        )
        steps = f.get("steps") or 0
        step = f.get("step") or 0
        bar = ""
        if steps:
            filled = int(20 * step / steps)
            bar = "[" + "#" * filled + "." * (20 - filled) + "]"
        t.add_row("inner step", f"{step}/{steps} {bar}")
        loss = f.get("loss")
        t.add_row("loss", f"{loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else "-")
        t.add_row("samples/s", f"{f.get('samples_per_s', 0.0):.1f}")
        t.add_row(
            "exchange sent / recv",
            f"{human_bytes(f.get('exchange_sent', 0))} / {human_bytes(f.get('exchange_received', 0))}",
        )
        t.add_row(
            "checkpoints up / down",
            f"{human_bytes(f.get('checkpoint_sent', 0))} / {human_bytes(f.get('checkpoint_received', 0))}",
        )
        left = self.deadline_left_s()
        t.add_row("deadline", "-" if left is None else f"in {left:.0f} s")
        return t

    @staticmethod
    def _format_event(name: str, fields: dict[str, Any]) -> str:
        msg = fields.get("message")
        rest = " ".join(f"{k}={v}" for k, v in fields.items() if k != "message")
        return f"{name}: {msg} {rest}".strip() if msg else f"{name} {rest}".strip()
