"""Durable coordinator state in one SQLite file (WAL): run spec, workers, assignments,
rounds, commits and the checkpoint index.

The pure core (`bagel.coordinator.core.state`) returns, with every transition, the durable
records that changed (`Outcome.effects`); the server writes them here in ONE transaction
before it replies, so an acknowledged state change survives a crash.
On start the daemon loads everything back and hands it to `CoordinatorState.restore`.

Durability: WAL journal with `synchronous=FULL`. In WAL mode NORMAL only syncs at
checkpoints, so a power loss (not a process crash) could roll back the last
acknowledged transactions; the contract is "durable before acknowledged", so every
commit syncs the WAL. The cost is one fsync per durable transaction, and the hot path
(heartbeats that change nothing durable) never writes.

Schema notes: records are stored as JSON documents next to the columns queries need
(ids, states, rounds). `commits` has PRIMARY KEY (cell_id, epoch, round): within one
lineage of a cell a committed round is recorded once and only once, which is what the
crash test checks. A second insert of the same key with the same hash is a no-op (a
retried write); with another hash it is an error (`StoreError`): two different committed
states of one round. The epoch is the cell's `rollbacks` count (`CellRecord.rollbacks`):
an orphaned cell falls back to its last checkpoint by design, and the
rounds after it are then re-run and committed again in the next epoch; the rolled-back
commits stay in the table as history, and `commits()`/`load()` return the current
epoch's.

Threads: the daemon writes from one dedicated thread (`bagel.coordinator.writer`), so
fsyncs never block the event loop, in submission order, several batches per transaction
when they queue up; `Store.open_readonly` serves `status` while a daemon runs (WAL
readers never block the writer).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import json
import sqlite3
import time
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bagel.coordinator.checkpoints import CheckpointMeta
from bagel.coordinator.core import records
from bagel.coordinator.core.records import CellRecord, CommitRecord, RoundRecord, RoundState, Snapshot, WorkerRecord
from bagel.protocol import messages
from bagel.protocol.jointoken import TokenBound, TokenRevoked, TokenUnknown, TokenUsedUp

SCHEMA_VERSION = 2  # 2: commits keyed by (cell_id, epoch, round)
DB_NAME = "coordinator.sqlite3"
STARTED_KEY = "daemon_started_unix_ms"  # kv: when the daemon last started (status --data-dir: uptime)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS run_spec (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    run_id TEXT NOT NULL,
    spec_hash TEXT NOT NULL,
    spec_toml TEXT NOT NULL,
    created_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    record TEXT NOT NULL,
    updated_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS assignments (
    worker_id TEXT PRIMARY KEY,
    cell_id TEXT NOT NULL,
    record TEXT NOT NULL,
    updated_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS cells (
    cell_id TEXT PRIMARY KEY,
    epoch INTEGER NOT NULL,
    record TEXT NOT NULL,
    updated_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (
    cell_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    state TEXT NOT NULL,
    record TEXT NOT NULL,
    updated_unix_ms INTEGER NOT NULL,
    PRIMARY KEY (cell_id, round, attempt)
);
CREATE TABLE IF NOT EXISTS commits (
    cell_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    round INTEGER NOT NULL,
    state_hash TEXT NOT NULL,
    record TEXT NOT NULL,
    committed_unix_ms INTEGER NOT NULL,
    PRIMARY KEY (cell_id, epoch, round)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    cell_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    state_hash TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    total_bytes INTEGER NOT NULL,
    path TEXT NOT NULL,
    created_unix_ms INTEGER NOT NULL,
    uploader TEXT NOT NULL,
    PRIMARY KEY (cell_id, round)
);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS join_tokens (
    token_id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    issued_unix_ms INTEGER NOT NULL,
    expires_unix_ms INTEGER NOT NULL,
    uses INTEGER NOT NULL,
    used INTEGER NOT NULL DEFAULT 0,
    bound_key TEXT NOT NULL DEFAULT '',
    revoked_unix_ms INTEGER NOT NULL DEFAULT 0
);
"""


class StoreError(Exception):
    """The store is unusable or would be made inconsistent."""


class SpecMismatchError(StoreError):
    """The data dir belongs to another run spec."""


@dataclass(frozen=True)
class StoredSpec:
    run_id: str
    spec_hash: str
    spec_toml: str
    created_unix_ms: int


@dataclass(frozen=True)
class JoinTokenRow:
    """What the store knows of an issued join token (the signed bytes are not kept)."""

    token_id: str  # hex
    name: str
    issued_unix_ms: int
    expires_unix_ms: int
    uses: int
    used: int = 0
    bound_key: str = ""  # hex Ed25519 public key of the worker it was bound to at first use
    revoked_unix_ms: int = 0


def _dumps(record: Any) -> str:
    return json.dumps(record, separators=(",", ":"), sort_keys=True)


class Store:
    """One SQLite connection to the coordinator database."""

    def __init__(self, conn: sqlite3.Connection, path: Path, *, readonly: bool) -> None:
        self._conn = conn
        self.path = path
        self.readonly = readonly

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, data_dir: str | Path) -> Store:
        """Open (creating if needed) the read-write store in `data_dir`."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / DB_NAME
        # check_same_thread=False: the AsyncWriter's thread owns writes; the connection is
        # never used from two threads at once (the writer is a single-thread executor).
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        store = cls(conn, path, readonly=False)
        store._migrate()
        return store

    @classmethod
    def open_readonly(cls, data_dir: str | Path) -> Store:
        """Read-only view (for `bagel-coordinator status` while the daemon runs)."""
        path = Path(data_dir) / DB_NAME
        if not path.exists():
            raise StoreError(f"no coordinator database at {path}")
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, timeout=30.0)
        store = cls(conn, path, readonly=True)
        version = store.schema_version()
        if version != SCHEMA_VERSION:
            raise StoreError(f"{path} has schema version {version}, this Bagel reads {SCHEMA_VERSION}")
        return store

    def _migrate(self) -> None:
        # executescript issues its own COMMIT, so it runs outside our transaction helper.
        self._conn.executescript(_SCHEMA)
        version = self.schema_version()
        if version is None:
            with self._tx():
                self._conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        elif version != SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has schema version {version}; this Bagel knows {SCHEMA_VERSION} "
                "and no migration path exists"
            )

    def schema_version(self) -> int | None:
        try:
            row = self._conn.execute("SELECT version FROM schema_version").fetchone()
        except sqlite3.OperationalError:
            return None
        return None if row is None else int(row[0])

    def close(self) -> None:
        self._conn.close()

    # ------------------------------------------------------------------ transactions

    class _Tx:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def __enter__(self) -> sqlite3.Connection:
            # IMMEDIATE: take the write lock up front, so a second writer fails fast
            # instead of deadlocking on upgrade.
            self.conn.execute("BEGIN IMMEDIATE")
            return self.conn

        def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
            if exc_type is None:
                self.conn.execute("COMMIT")
            else:
                self.conn.execute("ROLLBACK")

    def _tx(self) -> Store._Tx:
        if self.readonly:
            raise StoreError("the store is open read-only")
        return Store._Tx(self._conn)

    # ------------------------------------------------------------------ run spec

    def spec(self) -> StoredSpec | None:
        row = self._conn.execute(
            "SELECT run_id, spec_hash, spec_toml, created_unix_ms FROM run_spec WHERE id = 1"
        ).fetchone()
        return None if row is None else StoredSpec(*row)

    def bind_spec(self, run_id: str, spec_hash: str, spec_toml: str, now_ms: int) -> StoredSpec:
        """Record the run spec on first start; SpecMismatchError if another spec is stored."""
        existing = self.spec()
        if existing is not None:
            if existing.spec_hash != spec_hash or existing.run_id != run_id:
                raise SpecMismatchError(
                    f"the data dir {self.path.parent} belongs to run {existing.run_id!r} with spec "
                    f"hash {existing.spec_hash[:16]}..., but the given spec is run {run_id!r} with "
                    f"hash {spec_hash[:16]}...; a run spec is immutable once the run starts: use "
                    "the original spec file or a new --data-dir"
                )
            return existing
        with self._tx() as c:
            c.execute(
                "INSERT INTO run_spec (id, run_id, spec_hash, spec_toml, created_unix_ms) VALUES (1, ?, ?, ?, ?)",
                (run_id, spec_hash, spec_toml, now_ms),
            )
        return StoredSpec(run_id, spec_hash, spec_toml, now_ms)

    # ------------------------------------------------------------------ records

    def write(self, effects: Sequence[Any], now_ms: int | None = None) -> None:
        """Write a batch of durable records in ONE transaction (all or nothing)."""
        if not effects:
            return
        now = int(time.time() * 1000) if now_ms is None else now_ms
        self.write_many([(effects, now)])

    def write_many(self, batches: Sequence[tuple[Sequence[Any], int]]) -> None:
        """Several batches, in order, in ONE transaction and one fsync (group commit)."""
        with self._tx() as c:
            for effects, now in batches:
                # a commit belongs to its cell's lineage: the epoch in this batch's CellRecord
                # (a commit always changes its cell), else the stored one
                epochs = {e.cell_id: e.rollbacks for e in effects if isinstance(e, CellRecord)}
                for effect in effects:
                    _apply_effect(c, effect, now, epochs)

    def get_kv(self, key: str) -> Any:
        row = self._conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put_kv(self, key: str, value: Any) -> None:
        with self._tx() as c:
            _upsert(c, "kv", {"key": key}, value, 0)

    # ------------------------------------------------------------------ join tokens
    #
    # Written by `bagel-coordinator token` (its own connection, while the daemon may run:
    # WAL, BEGIN IMMEDIATE, a 30 s busy timeout) and by the daemon's writer thread on
    # Register; the daemon reads the row on every Register with a token, so a revocation
    # takes effect at once, and polls `revoked_bound_keys` to remove revoked workers.

    def add_token(self, token: JoinTokenRow) -> None:
        """Record an issued token; StoreError if its name or id is taken."""
        try:
            with self._tx() as c:
                c.execute(
                    "INSERT INTO join_tokens (token_id, name, issued_unix_ms, expires_unix_ms, uses)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (token.token_id, token.name, token.issued_unix_ms, token.expires_unix_ms, token.uses),
                )
        except sqlite3.IntegrityError:
            raise StoreError(f"a token named {token.name!r} exists already") from None

    def list_tokens(self) -> list[JoinTokenRow]:
        q = (
            "SELECT token_id, name, issued_unix_ms, expires_unix_ms, uses, used, bound_key, revoked_unix_ms"
            " FROM join_tokens ORDER BY issued_unix_ms, name"
        )
        try:
            return [JoinTokenRow(*r) for r in self._conn.execute(q)]
        except sqlite3.OperationalError:  # a read-only view of a store older than the table
            return []

    def revoke_token(self, name_or_id: str, now_ms: int) -> JoinTokenRow:
        """Revoke by name or token id (a revoked token stays revoked); StoreError if none."""
        with self._tx() as c:
            row = c.execute(
                "SELECT token_id FROM join_tokens WHERE name = ? OR token_id = ?", (name_or_id, name_or_id)
            ).fetchone()
            if row is None:
                raise StoreError(f"no token named or with id {name_or_id!r}")
            c.execute(
                "UPDATE join_tokens SET revoked_unix_ms = ? WHERE token_id = ? AND revoked_unix_ms = 0",
                (now_ms, row[0]),
            )
        return next(t for t in self.list_tokens() if t.token_id == row[0])

    def use_token(self, token_id: str, key_hex: str, consume: bool) -> tuple[int, str]:
        """Admit `key_hex` with the token, in one transaction; returns (used, bound_key) before.

        The token binds to the first key that uses it; another key is refused. `consume`
        counts a use (a joined worker registering again does not). Raises a
        `JoinTokenError` (and changes nothing) when the token is unknown, revoked, bound
        to another key or used up.
        """
        with self._tx() as c:
            row = c.execute(
                "SELECT uses, used, bound_key, revoked_unix_ms FROM join_tokens WHERE token_id = ?", (token_id,)
            ).fetchone()
            if row is None:
                raise TokenUnknown("join token was not issued by this coordinator")
            uses, used, bound, revoked = int(row[0]), int(row[1]), str(row[2]), int(row[3])
            if revoked:
                raise TokenRevoked("join token was revoked by the operator")
            if bound and bound != key_hex:
                raise TokenBound("join token is bound to another worker key")
            if consume and used >= uses:
                raise TokenUsedUp(f"join token has no uses left (all {uses} used)")
            c.execute(
                "UPDATE join_tokens SET used = ?, bound_key = ? WHERE token_id = ?",
                (used + (1 if consume else 0), key_hex, token_id),
            )
        return used, bound

    def restore_token(self, token_id: str, used: int, bound_key: str) -> None:
        """Undo a `use_token` whose registration the core then refused."""
        with self._tx() as c:
            c.execute("UPDATE join_tokens SET used = ?, bound_key = ? WHERE token_id = ?", (used, bound_key, token_id))

    def revoked_bound_keys(self) -> list[str]:
        """Worker keys (hex) bound to a revoked token."""
        q = "SELECT bound_key FROM join_tokens WHERE revoked_unix_ms > 0 AND bound_key != ''"
        try:
            return [str(r[0]) for r in self._conn.execute(q)]
        except sqlite3.OperationalError:
            return []

    # ------------------------------------------------------------------ checkpoint index

    def add_checkpoint(self, meta: CheckpointMeta) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO checkpoints (cell_id, round, state_hash, sha256, total_bytes, path,"
                " created_unix_ms, uploader) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    meta.cell_id,
                    meta.round,
                    meta.state_hash,
                    meta.sha256,
                    meta.total_bytes,
                    meta.path,
                    meta.created_unix_ms,
                    meta.uploader,
                ),
            )

    def remove_checkpoint(self, cell_id: str, round: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM checkpoints WHERE cell_id = ? AND round = ?", (cell_id, round))

    def list_checkpoints(self, cell_id: str | None = None) -> list[CheckpointMeta]:
        q = "SELECT cell_id, round, state_hash, sha256, total_bytes, path, created_unix_ms, uploader FROM checkpoints"
        rows = (
            self._conn.execute(q + " WHERE cell_id = ? ORDER BY round", (cell_id,))
            if cell_id is not None
            else self._conn.execute(q + " ORDER BY cell_id, round")
        )
        return [CheckpointMeta(*r) for r in rows]

    # ------------------------------------------------------------------ reading

    _CURRENT = " FROM commits m LEFT JOIN cells c ON c.cell_id = m.cell_id WHERE m.epoch = COALESCE(c.epoch, 0)"

    def commits(self) -> list[tuple[str, int, str]]:
        """(cell_id, round, state_hash) of the committed rounds of each cell's current epoch."""
        q = "SELECT m.cell_id, m.round, m.state_hash" + self._CURRENT + " ORDER BY m.cell_id, m.round"
        return [(r[0], int(r[1]), r[2]) for r in self._conn.execute(q)]

    def commit_history(self) -> list[tuple[str, int, int, str]]:
        """(cell_id, epoch, round, state_hash) of every commit ever recorded, rolled back or not."""
        q = "SELECT cell_id, epoch, round, state_hash FROM commits ORDER BY cell_id, epoch, round"
        return [(r[0], int(r[1]), int(r[2]), r[3]) for r in self._conn.execute(q)]

    def commit_rows(self) -> list[tuple[str, int, int, str, int]]:
        """(cell_id, epoch, round, state_hash, committed_unix_ms) of every commit ever
        recorded, rolled back or not, by cell, epoch and round."""
        q = "SELECT cell_id, epoch, round, state_hash, committed_unix_ms FROM commits ORDER BY cell_id, epoch, round"
        return [(r[0], int(r[1]), int(r[2]), r[3], int(r[4])) for r in self._conn.execute(q)]

    def commit_records(self) -> list[CommitRecord]:
        """The CommitRecords of each cell's current epoch, by (cell, round)."""
        q = "SELECT m.record" + self._CURRENT + " ORDER BY m.cell_id, m.round"
        return [from_json(CommitRecord, json.loads(r[0])) for r in self._conn.execute(q)]

    def round_records(self) -> list[RoundRecord]:
        """Every round attempt ever recorded (open or ended), by key."""
        q = "SELECT record FROM rounds ORDER BY cell_id, round, attempt"
        return [from_json(RoundRecord, json.loads(r[0])) for r in self._conn.execute(q)]

    def load(self, *, recent_commits: int = 64) -> Snapshot:
        """The records `CoordinatorState.restore` needs, read in one consistent transaction:
        every worker and cell, the open (non-terminal) round attempts, and the last
        `recent_commits` commits of each cell (enough to verify late checkpoint uploads)."""
        c = self._conn
        c.execute("BEGIN")
        try:
            workers = tuple(
                from_json(WorkerRecord, json.loads(r[0]))
                for r in c.execute("SELECT record FROM workers ORDER BY worker_id")
            )
            cells = tuple(
                from_json(CellRecord, json.loads(r[0])) for r in c.execute("SELECT record FROM cells ORDER BY cell_id")
            )
            terminal = (RoundState.COMMITTED.value, RoundState.ABORTED.value)
            rounds = tuple(
                from_json(RoundRecord, json.loads(r[0]))
                for r in c.execute(
                    "SELECT record FROM rounds WHERE state NOT IN (?, ?) ORDER BY cell_id, round, attempt", terminal
                )
            )
            commits = tuple(
                from_json(CommitRecord, json.loads(r[0]))
                for r in c.execute(
                    "SELECT record FROM (SELECT m.record AS record, m.cell_id AS cell_id, m.round AS round,"
                    " ROW_NUMBER() OVER (PARTITION BY m.cell_id ORDER BY m.round DESC) AS k"
                    + self._CURRENT
                    + ") WHERE k <= ? ORDER BY cell_id, round",
                    (recent_commits,),
                )
            )
        finally:
            c.execute("COMMIT")
        return Snapshot(workers=workers, cells=cells, rounds=rounds, commits=commits)

    def recent_rounds(self, limit: int = 20) -> list[RoundRecord]:
        """The latest `limit` round attempts of any state, newest first (status views)."""
        return [
            from_json(RoundRecord, json.loads(r[0]))
            for r in self._conn.execute(
                "SELECT record FROM rounds ORDER BY updated_unix_ms DESC, cell_id, round DESC, attempt DESC LIMIT ?",
                (limit,),
            )
        ]

    def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every table, raw: tests compare dumps to prove nothing changed."""
        tables = [r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        # table names come from sqlite_master, not from input
        return {t: sorted(self._conn.execute(f"SELECT * FROM {t}"), key=repr) for t in tables}  # noqa: S608


# ---------------------------------------------------------------------- effect -> rows

_KEYS: dict[str, tuple[str, ...]] = {
    "workers": ("worker_id",),
    "assignments": ("worker_id",),
    "cells": ("cell_id",),
    "rounds": ("cell_id", "round", "attempt"),
    "commits": ("cell_id", "epoch", "round"),
    "kv": ("key",),
}


def _upsert(c: sqlite3.Connection, table: str, key: dict[str, Any], record: dict[str, Any], now_ms: int) -> None:
    if table not in _KEYS:
        raise StoreError(f"unknown table {table!r}")
    body = _dumps(record)
    if table == "workers":
        c.execute(
            "INSERT INTO workers (worker_id, state, record, updated_unix_ms) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (worker_id) DO UPDATE SET state = excluded.state, record = excluded.record,"
            " updated_unix_ms = excluded.updated_unix_ms",
            (key["worker_id"], str(record.get("state", "")), body, now_ms),
        )
    elif table == "assignments":
        c.execute(
            "INSERT INTO assignments (worker_id, cell_id, record, updated_unix_ms) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (worker_id) DO UPDATE SET cell_id = excluded.cell_id, record = excluded.record,"
            " updated_unix_ms = excluded.updated_unix_ms",
            (key["worker_id"], str(record.get("cell_id", "")), body, now_ms),
        )
    elif table == "cells":
        c.execute(
            "INSERT INTO cells (cell_id, epoch, record, updated_unix_ms) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (cell_id) DO UPDATE SET epoch = excluded.epoch, record = excluded.record,"
            " updated_unix_ms = excluded.updated_unix_ms",
            (key["cell_id"], int(record.get("rollbacks", 0)), body, now_ms),
        )
    elif table == "rounds":
        c.execute(
            "INSERT INTO rounds (cell_id, round, attempt, state, record, updated_unix_ms) VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (cell_id, round, attempt) DO UPDATE SET state = excluded.state,"
            " record = excluded.record, updated_unix_ms = excluded.updated_unix_ms",
            (key["cell_id"], int(key["round"]), int(key["attempt"]), str(record.get("state", "")), body, now_ms),
        )
    elif table == "commits":
        cell, epoch, rnd, h = key["cell_id"], int(key["epoch"]), int(key["round"]), str(record["state_hash"])
        row = c.execute(
            "SELECT state_hash FROM commits WHERE cell_id = ? AND epoch = ? AND round = ?", (cell, epoch, rnd)
        ).fetchone()
        if row is not None:
            if row[0] != h:
                raise StoreError(f"round {rnd} of {cell} (epoch {epoch}) is already committed with another hash")
            return  # the same commit written twice (a retried batch): idempotent
        c.execute(
            "INSERT INTO commits (cell_id, epoch, round, state_hash, record, committed_unix_ms)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (cell, epoch, rnd, h, body, int(record.get("committed_unix_ms", now_ms))),
        )
    elif table == "kv":
        c.execute(
            "INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key["key"], body),
        )


def _delete(c: sqlite3.Connection, table: str, key: dict[str, Any]) -> None:
    cols = _KEYS.get(table)
    if cols is None:
        raise StoreError(f"unknown table {table!r}")
    where = " AND ".join(f"{col} = ?" for col in cols)
    c.execute(f"DELETE FROM {table} WHERE {where}", tuple(key[col] for col in cols))  # noqa: S608


def _epoch(c: sqlite3.Connection, cell_id: str, epochs: Mapping[str, int]) -> int:
    if cell_id in epochs:
        return epochs[cell_id]
    row = c.execute("SELECT epoch FROM cells WHERE cell_id = ?", (cell_id,)).fetchone()
    return 0 if row is None else int(row[0])


def _apply_effect(c: sqlite3.Connection, effect: Any, now_ms: int, epochs: Mapping[str, int]) -> None:
    """Translate one core record (`Outcome.effects`) into rows."""
    if isinstance(effect, WorkerRecord):
        body = to_json(effect)
        _upsert(c, "workers", {"worker_id": effect.worker_id}, body, now_ms)
        if effect.cell_id:
            _upsert(
                c,
                "assignments",
                {"worker_id": effect.worker_id},
                {"worker_id": effect.worker_id, "cell_id": effect.cell_id},
                now_ms,
            )
        else:
            _delete(c, "assignments", {"worker_id": effect.worker_id})
    elif isinstance(effect, CellRecord):
        _upsert(c, "cells", {"cell_id": effect.cell_id}, to_json(effect), now_ms)
    elif isinstance(effect, RoundRecord):
        key = {"cell_id": effect.cell_id, "round": effect.round, "attempt": effect.attempt}
        _upsert(c, "rounds", key, to_json(effect), now_ms)
    elif isinstance(effect, CommitRecord):
        body = to_json(effect)
        body["committed_unix_ms"] = effect.committed_ms
        key = {"cell_id": effect.cell_id, "epoch": _epoch(c, effect.cell_id, epochs), "round": effect.round}
        _upsert(c, "commits", key, body, now_ms)
    else:
        raise StoreError(f"unknown effect {type(effect).__name__}")


# ---------------------------------------------------------------------- record <-> JSON


def to_json(obj: Any) -> Any:
    """A domain record as JSON-able data: dataclasses -> dicts, enums -> values,
    tuples -> lists, mappings -> dicts (keys must be strings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_json(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_json(v) for k, v in obj.items()}
    return obj


_HINTS: dict[type, dict[str, Any]] = {}


def from_json(tp: Any, data: Any) -> Any:
    """Inverse of `to_json`, driven by the type annotations of the domain dataclasses."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return from_json(inner, data)
    if origin is tuple:
        (inner, _ellipsis) = typing.get_args(tp)
        return tuple(from_json(inner, v) for v in data)
    if origin in (Mapping, dict, collections.abc.Mapping):
        _k, inner = typing.get_args(tp)
        return {str(k): from_json(inner, v) for k, v in data.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = _HINTS.get(tp)
        if hints is None:
            hints = _HINTS[tp] = typing.get_type_hints(tp, {**vars(messages), **vars(records)})
        names = {f.name for f in dataclasses.fields(tp)}
        return tp(**{k: from_json(hints[k], v) for k, v in data.items() if k in names})
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(data)
    if tp is float:
        return float(data)
    if tp is int:
        return int(data)
    return data
