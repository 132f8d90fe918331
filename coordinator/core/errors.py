"""Typed errors of the coordinator core, and the one table that maps them to gRPC statuses.

A transition that raises leaves the state unchanged (the core validates before it
mutates). The shell's single interceptor looks the exception's class up in
`GRPC_STATUS` (walking the MRO, so subclasses inherit their parent's code); the core does
not import grpc, so the table holds status *names* (`grpc.StatusCode[name]`).
Style: Psyche's coordinator errors and text-generation-inference's interceptor.
"""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of every error the core raises on a bad or ill-timed event."""


class InvalidEvent(CoordinatorError):
    """A field is out of range or inconsistent (negative samples, unknown cell id, ...)."""


class UnknownWorker(CoordinatorError):
    """No active worker with this id (never registered, lost, or left): re-register."""


class InvalidRunState(CoordinatorError):
    """The event does not fit the run's or cell's state (e.g. a checkpoint of an
    uncommitted round, an upload nobody asked for)."""


class WrongCell(InvalidRunState):
    """The event names a cell the worker is not assigned to."""


class WrongPhase(InvalidRunState):
    """The event does not fit the round's state (e.g. a report before the freeze, from a
    member that was not frozen in)."""


class StaleRound(InvalidRunState):
    """A late message about a round (or contributor set) that is already superseded.

    Late messages that are harmless are *not* errors: a duplicate report of the round just
    committed gets its verdict again, a report of an aborted attempt gets VERDICT_ABORTED,
    a READY heartbeat of an old attempt is ignored (Psyche accepts a late warmup witness
    as a no-op the same way). StaleRound is for the rest, e.g. a report of a round older
    than the last commit, or of a contributor set that has been re-frozen.
    """


class DuplicateSubmission(CoordinatorError):
    """A second, different report for the same contributor set."""


class Banned(CoordinatorError):
    """The worker was banned from the run (reputation past schedule.ban_reputation)."""


class CapacityExceeded(CoordinatorError):
    """The run already has `max_workers` active workers."""


class CoreFault(Exception):
    """A transition failed with an exception that is not a `CoordinatorError`: a bug in the
    core, possibly raised after it mutated memory. Deliberately not a `CoordinatorError`:
    nobody answers it as a refusal. The state refuses every later event, and the daemon
    stops (non-zero) so that it restarts from what SQLite holds."""


# gRPC status code *names* (grpc.StatusCode[name]); looked up along the exception's MRO.
GRPC_STATUS: dict[type[CoordinatorError], str] = {
    CoordinatorError: "INTERNAL",
    InvalidEvent: "INVALID_ARGUMENT",
    UnknownWorker: "NOT_FOUND",
    InvalidRunState: "FAILED_PRECONDITION",
    WrongCell: "FAILED_PRECONDITION",
    WrongPhase: "FAILED_PRECONDITION",
    StaleRound: "FAILED_PRECONDITION",
    DuplicateSubmission: "ALREADY_EXISTS",
    Banned: "PERMISSION_DENIED",
    CapacityExceeded: "RESOURCE_EXHAUSTED",
}


def grpc_status_name(error: BaseException) -> str:
    """The gRPC status name for a core error (its closest class in GRPC_STATUS)."""
    for cls in type(error).__mro__:
        name = GRPC_STATUS.get(cls)
        if name is not None:
            return name
    return "INTERNAL"
