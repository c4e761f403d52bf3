"""The one exception hierarchy of Tenplex.

Every error a user can cause or meet derives from :class:`TenplexError`. Each
class carries a stable machine-readable ``code`` and the HTTP status the REST
layers (store and scheduler) answer with, so that both map exceptions to
``{"error": code, "detail": message}`` the same way.
"""

from __future__ import annotations


class TenplexError(Exception):
    """Base class. ``detail`` is the human-readable message."""

    code: str = "tenplex_error"
    http_status: int = 500

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def to_json(self) -> dict[str, str]:
        return {"error": self.code, "detail": self.detail}


class InvalidInput(TenplexError):
    """A request, file or argument is malformed."""

    code = "invalid_input"
    http_status = 400


class InvalidRegion(InvalidInput):
    """A region is malformed or does not fit the tensor it addresses."""

    code = "invalid_region"
    http_status = 400


class RegionOutOfBounds(InvalidRegion):
    """A well-formed region lies (partly) outside the tensor."""

    code = "region_out_of_bounds"
    http_status = 416


class InvalidPTC(InvalidInput):
    """A parallelizable tensor collection violates an invariant."""

    code = "invalid_ptc"


class InvalidConfig(InvalidInput):
    """A parallel configuration or model description is inconsistent."""

    code = "invalid_config"


class Unauthorized(TenplexError):
    """No credential, or one that is forged, expired or signed with an unknown key."""

    code = "unauthorized"
    http_status = 401


class Forbidden(TenplexError):
    """A valid credential that does not reach this job or route (another job's, a worker's on an admin route)."""

    code = "forbidden"
    http_status = 403


class NotFound(TenplexError):
    code = "not_found"
    http_status = 404


class Conflict(TenplexError):
    """The request contradicts the current state (e.g. writing a committed version)."""

    code = "conflict"
    http_status = 409


class ChecksumMismatch(TenplexError):
    """Bytes read back do not match the checksum recorded when they were written."""

    code = "checksum_mismatch"
    http_status = 500


class StoreUnavailable(TenplexError):
    """A store server could not be reached or kept failing after the retries."""

    code = "store_unavailable"
    http_status = 503


class StateLost(TenplexError):
    """Some regions of the job state are held by no surviving host."""

    code = "state_lost"
    http_status = 409


class SchedulerUnavailable(TenplexError):
    """The scheduler could not be reached, or kept failing, after the retries (a worker's view)."""

    code = "scheduler_unavailable"
    http_status = 503


class NotLeader(TenplexError):
    """This scheduler replica does not hold the leader Lease (or is still resuming the jobs): ask again.

    503, so that workers retry, and a retry through the scheduler's Service can
    reach the leader; a 404 would tell them their job is gone."""

    code = "not_leader"
    http_status = 503


class TransformFailed(TenplexError):
    """A state transformation could not complete; the old version is intact."""

    code = "transform_failed"
    http_status = 500


class TransformCancelled(TransformFailed):
    """A state transformation was cancelled before it committed; nothing of it is kept."""

    code = "transform_cancelled"
    http_status = 409


def error_class(code: str) -> type[TenplexError] | None:
    """The :class:`TenplexError` subclass whose ``code`` is ``code``, for clients rebuilding a server's error.

    Walks the hierarchy at each call (it is small), so subclasses defined in other
    modules, such as a client's own unavailability error, are found once imported.
    """
    stack: list[type[TenplexError]] = [TenplexError]
    while stack:
        cls = stack.pop()
        if cls.code == code:
            return cls
        stack.extend(cls.__subclasses__())
    return None
