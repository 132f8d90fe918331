"""The one place where exceptions become gRPC statuses: shell errors, `classify_error`, `ErrorInterceptor`.

`ErrorInterceptor` parses the raw request bytes itself, so even an unparseable message
gets INVALID_ARGUMENT, and wraps every Coordinator method so that no handler can forget
the mapping. Why an interceptor rather than a decorator: grpc.aio's `ServerInterceptor`
only sees the handler *lookup*, not its exceptions, but it may return a different handler;
ours wraps each method's behaviour (text-generation-inference's interceptor does the same).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from bagel.coordinator.checkpoints import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointRejected,
    CheckpointTooLarge,
)
from bagel.coordinator.core.errors import CoordinatorError, grpc_status_name
from bagel.coordinator.metrics import Metrics
from bagel.protocol.envelope import EnvelopeError
from bagel.protocol.jointoken import JoinTokenError
from bagel.protocol.validation import ValidationError
from bagel.robust.evidence import EvidenceError

log = logging.getLogger(__name__)


SERVICE_NAME = "bagel.v1.Coordinator"
_METHOD_PREFIX = f"/{SERVICE_NAME}/"


class ShellError(Exception):
    """An error raised by the shell itself; `status` is its gRPC code."""

    status = grpc.StatusCode.INTERNAL
    reason = "shell"


class MalformedMessage(ShellError):
    status = grpc.StatusCode.INVALID_ARGUMENT
    reason = "malformed_message"


class UploadProtocolError(ShellError):
    status = grpc.StatusCode.INVALID_ARGUMENT
    reason = "upload_protocol"


class NotAccepting(ShellError):
    """Shutting down, or stopped after a store failure: try again (another coordinator)."""

    status = grpc.StatusCode.UNAVAILABLE
    reason = "unavailable"


class AccusationLimited(ShellError):
    """Too many accusations from this worker, or too many being checked at once: later."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "accusation_rate"


_CHECKPOINT_STATUS: dict[type, tuple[grpc.StatusCode, str]] = {
    CheckpointTooLarge: (grpc.StatusCode.RESOURCE_EXHAUSTED, "checkpoint_too_large"),
    CheckpointRejected: (grpc.StatusCode.INVALID_ARGUMENT, "checkpoint_rejected"),
    CheckpointNotFound: (grpc.StatusCode.NOT_FOUND, "checkpoint_not_found"),
    CheckpointCorrupt: (grpc.StatusCode.DATA_LOSS, "checkpoint_corrupt"),
}


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def classify_error(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status, metric reason, details) for an exception raised while serving a request."""
    if isinstance(exc, ValidationError):
        top = exc.field.split(".", 1)[0].split("[", 1)[0]  # bounded label: the top-level field
        return grpc.StatusCode.INVALID_ARGUMENT, f"invalid_{top}", str(exc)
    if isinstance(exc, (EnvelopeError, JoinTokenError)):
        return exc.status, _snake(type(exc).__name__), str(exc)
    if isinstance(exc, CoordinatorError):
        return grpc.StatusCode[grpc_status_name(exc)], _snake(type(exc).__name__), str(exc) or type(exc).__name__
    if isinstance(exc, ShellError):
        return exc.status, exc.reason, str(exc)
    if isinstance(exc, EvidenceError):
        return grpc.StatusCode[exc.status], exc.reason, str(exc)
    for cls in type(exc).__mro__:
        if cls in _CHECKPOINT_STATUS:
            code, reason = _CHECKPOINT_STATUS[cls]
            return code, reason, str(exc)
    return grpc.StatusCode.INTERNAL, "internal", f"internal error ({type(exc).__name__}); see the coordinator log"


# ---------------------------------------------------------------------------- interceptor


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every Coordinator handler: request parsing, exception -> status, metrics.

    The wrapped handler receives raw bytes (no request deserializer), parses them itself
    and turns a DecodeError into INVALID_ARGUMENT (gRPC would answer INTERNAL). Any
    other unexpected exception becomes INTERNAL with the traceback logged; the daemon
    keeps serving. Health and reflection handlers pass through untouched.
    """

    def __init__(self, metrics: Metrics, limit_peer: Callable[[str], None] | None = None) -> None:
        self._metrics = metrics
        self._cache: dict[str, grpc.RpcMethodHandler] = {}
        # the per-address rate limit (`Admission`), applied before a request is parsed
        self._limit_peer = limit_peer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        full = handler_call_details.method
        cached = self._cache.get(full)
        if cached is not None:
            return cached
        handler = await continuation(handler_call_details)
        if handler is None or not full.startswith(_METHOD_PREFIX):
            return handler
        wrapped = self._wrap(full[len(_METHOD_PREFIX) :], handler)
        self._cache[full] = wrapped
        return wrapped

    async def _fail(self, method: str, exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        code, reason, details = classify_error(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed:\n%s", method, "".join(traceback.format_exception(exc)))
        self._metrics.reject(reason)
        retry_after_ms = getattr(exc, "retry_after_ms", None)
        if isinstance(retry_after_ms, int):
            context.set_trailing_metadata((("bagel-retry-after-ms", str(retry_after_ms)),))
        await context.abort(code, details[:1000])

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer
        if deserialize is None:  # every generated Coordinator handler has one: nothing to parse
            return handler
        metrics = self._metrics
        fail = self._fail
        limit_peer = self._limit_peer

        def admit(context: grpc.aio.ServicerContext) -> None:
            if limit_peer is not None:
                limit_peer(context.peer() or "")

        def parse(raw: bytes) -> Message:
            try:
                return deserialize(raw)
            except DecodeError as e:
                raise MalformedMessage(f"request does not parse: {e}") from None

        async def parse_stream(raw_iter: AsyncIterator[bytes]) -> AsyncIterator[Message]:
            async for raw in raw_iter:
                yield parse(raw)

        # grpc's stubs type a handler's behaviours as sync (grpc.ServicerContext, Iterator);
        # under grpc.aio they are coroutine functions of a grpc.aio.ServicerContext.
        if handler.unary_unary is not None:
            inner_uu: Any = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                t0 = time.perf_counter()
                code = "OK"
                try:
                    admit(context)
                    return await inner_uu(parse(raw), context)
                except grpc.aio.AbortError:
                    code = "ABORTED_BY_HANDLER"
                    raise
                except Exception as e:
                    code = classify_error(e)[0].name
                    await fail(method, e, context)
                finally:
                    metrics.observe_rpc(method, time.perf_counter() - t0, code)

            serialize: Any = handler.response_serializer

            def serialize_or_pass(response: Any) -> bytes:
                # a handler may answer bytes it serialized once for many callers (GetStatus's cache)
                return response if isinstance(response, bytes) else bytes(serialize(response))

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=None,
                response_serializer=serialize_or_pass if serialize is not None else None,
            )
        if handler.unary_stream is not None:
            inner_us: Any = handler.unary_stream

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                t0 = time.perf_counter()
                code = "OK"
                try:
                    admit(context)
                    async for item in inner_us(parse(raw), context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    code = classify_error(e)[0].name
                    await fail(method, e, context)
                finally:
                    metrics.observe_rpc(method, time.perf_counter() - t0, code)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=None, response_serializer=handler.response_serializer
            )
        if handler.stream_unary is not None:
            inner_su: Any = handler.stream_unary

            async def stream_unary(raw_iter: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
                t0 = time.perf_counter()
                code = "OK"
                try:
                    admit(context)
                    return await inner_su(parse_stream(raw_iter), context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    code = classify_error(e)[0].name
                    await fail(method, e, context)
                finally:
                    metrics.observe_rpc(method, time.perf_counter() - t0, code)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, request_deserializer=None, response_serializer=handler.response_serializer
            )
        return handler  # no stream-stream methods in the Coordinator service
