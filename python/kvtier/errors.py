"""Exceptions: one class per gRPC status code, all subclasses of
:class:`KvtierError`. The server's messages start with the request field
they are about (``"sequence_id: no such sequence"``), kept in
:attr:`KvtierError.field`."""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple, Type


class KvtierError(Exception):
    """A call the server (or the connection) refused."""

    #: The gRPC status code's name, e.g. ``"NOT_FOUND"``.
    code: str = "UNKNOWN"

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.message = message
        #: The request field the message names, e.g. ``"shard.world"``.
        self.field = field
        #: In a cluster: ``(node_id, address)`` of the node that has (or is
        #: to have) the sequence, when this node refused for that reason.
        self.owner: Optional[Tuple[str, str]] = None

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class Cancelled(KvtierError):
    code = "CANCELLED"


class Unknown(KvtierError):
    code = "UNKNOWN"


class InvalidArgument(KvtierError, ValueError):
    """The request is malformed; nothing changed."""

    code = "INVALID_ARGUMENT"


class DeadlineExceeded(KvtierError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class NotFound(KvtierError, LookupError):
    """No such sequence, lease or shared-memory region (for this tenant)."""

    code = "NOT_FOUND"


class AlreadyExists(KvtierError):
    code = "ALREADY_EXISTS"


class PermissionDenied(KvtierError, PermissionError):
    code = "PERMISSION_DENIED"


class ResourceExhausted(KvtierError):
    """A tier, quota or budget has no room; nothing changed."""

    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(KvtierError):
    """Legal request, wrong state (an illegal transition, a position guard)."""

    code = "FAILED_PRECONDITION"


class Aborted(KvtierError):
    code = "ABORTED"


class OutOfRange(KvtierError, IndexError):
    code = "OUT_OF_RANGE"


class Unimplemented(KvtierError, NotImplementedError):
    code = "UNIMPLEMENTED"


class Internal(KvtierError):
    code = "INTERNAL"


class Unavailable(KvtierError, ConnectionError):
    """The server cannot be reached (or is shutting down); safe to retry."""

    code = "UNAVAILABLE"


class DataLoss(KvtierError):
    code = "DATA_LOSS"


class Unauthenticated(KvtierError, PermissionError):
    code = "UNAUTHENTICATED"


_BY_CODE: Dict[int, Type[KvtierError]] = {
    1: Cancelled,
    2: Unknown,
    3: InvalidArgument,
    4: DeadlineExceeded,
    5: NotFound,
    6: AlreadyExists,
    7: PermissionDenied,
    8: ResourceExhausted,
    9: FailedPrecondition,
    10: Aborted,
    11: OutOfRange,
    12: Unimplemented,
    13: Internal,
    14: Unavailable,
    15: DataLoss,
    16: Unauthenticated,
}

_FIELD = re.compile(r"^([a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)*): ")


def from_status(code: int, message: str, owner: Optional[Tuple[str, str]] = None) -> KvtierError:
    """The exception for a gRPC status (called by the native module)."""
    match = _FIELD.match(message)
    error = _BY_CODE.get(code, Unknown)(message, match.group(1) if match else None)
    error.owner = owner
    return error
