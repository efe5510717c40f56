"""Exceptions of the attnd client: every failed call raises an AttndError.

An AttndError carries the gRPC status code (``.code``, a ``grpc.StatusCode``) and attnd's message
(``.message``), which names the field at fault for a bad request. Subclasses exist for the codes
callers handle differently, so that ``except attnd.NotFound`` reads as what it means; a code
without one of its own raises AttndError itself.
"""

from __future__ import annotations

from typing import Optional

import grpc


class AttndError(Exception):
    """A call to attnd failed; ``code`` is the gRPC status code, ``message`` attnd's text."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        if code is not None:
            self.code = code
        self.message = message
        super().__init__(f"{self.code.name}: {message}")

    def __reduce__(self):  # picklable (multiprocessing, concurrent.futures) with its code
        return (error_for, (self.code, self.message))


class InvalidArgument(AttndError, ValueError):
    """INVALID_ARGUMENT: shapes, sizes, dtypes, head dims, cu_seqlens, regions; names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(AttndError, KeyError):
    """NOT_FOUND: an unknown, closed or expired session, or an unknown region."""

    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class ResourceExhausted(AttndError):
    """RESOURCE_EXHAUSTED: a queue, pool, KV cache, session or message-size limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(AttndError):
    """FAILED_PRECONDITION: e.g. a session of another replica, shared memory not allowed."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(AttndError, ConnectionError):
    """UNAVAILABLE: attnd is unreachable or draining; safe to retry an idempotent call."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(AttndError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's timeout passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(AttndError):
    """UNAUTHENTICATED: no valid bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Cancelled(AttndError):
    """CANCELLED: the call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class AlreadyExists(AttndError):
    """ALREADY_EXISTS: e.g. a region name this client has registered already."""

    code = grpc.StatusCode.ALREADY_EXISTS


class BatchStepError(AttndError):
    """One or more items of a batch_step failed (the others were applied).

    ``results`` has one entry per item, in order: a StepResult, or the AttndError of that item.
    ``code`` and ``message`` are those of the first failed item.
    """

    def __init__(self, results: list):
        self.results = results
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, AttndError)]
        first_index, first = failed[0]
        self.code = first.code
        super().__init__(f"{len(failed)} of {len(results)} steps failed; item {first_index}: "
                         f"{first.message}", first.code)


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgument, NotFound, ResourceExhausted, FailedPrecondition, Unavailable, DeadlineExceeded,
    Unauthenticated, Cancelled, AlreadyExists)}
_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """grpc.StatusCode for a numeric code (as attnd puts in a stream item or a BatchStep result)."""
    return _CODE_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def error_for(code: grpc.StatusCode, message: str) -> AttndError:
    """The AttndError (subclass) for a status."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else AttndError(message, code)


def from_rpc_error(e: grpc.RpcError) -> AttndError:
    """The AttndError for a failed gRPC call (sync or asyncio)."""
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return error_for(code, details or "")
