"""One exception base for the project; each subclass also inherits the stdlib class it refines
and carries the HTTP status the server answers it with."""

from __future__ import annotations

__all__ = [
    "AgentboltError",
    "AttemptEnded",
    "ConfigError",
    "Conflict",
    "Forbidden",
    "InvalidInput",
    "IdempotencyKeyReused",
    "InvalidTransition",
    "LeaseLost",
    "MissingExtra",
    "NotFound",
    "QuotaExceeded",
    "ServerFailed",
    "ServerUnavailable",
    "StoreUnavailable",
    "WorkerRevoked",
    "WorkerTokenExpired",
]


class AgentboltError(Exception):
    status_code = 500

    @classmethod
    def from_message(cls, message: str) -> AgentboltError:
        """Rebuild an error from the message a server sent (the client side of an HTTP error)."""
        err = cls.__new__(cls)
        Exception.__init__(err, message)
        return err

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else type(self).__name__


class NotFound(AgentboltError, KeyError):
    status_code = 404

    def __init__(self, kind: str, object_id: object) -> None:
        super().__init__(f"{kind} {object_id!r} not found")
        self.kind, self.object_id = kind, object_id


class InvalidTransition(AgentboltError, ValueError):
    status_code = 409

    def __init__(self, kind: str, object_id: str, old: str, new: str) -> None:
        super().__init__(f"{kind} {object_id!r} cannot go from {old!r} to {new!r}")
        self.kind, self.object_id, self.old, self.new = kind, object_id, old, new


class LeaseLost(AgentboltError, RuntimeError):
    """The attempt is no longer held by the caller (it ended, expired or belongs to another)."""

    status_code = 409


class AttemptEnded(LeaseLost):
    """The attempt is no longer running (finished, cancelled, lease expired); the message names
    its state. Its holder stops the work: nothing it reports would be kept."""


class Conflict(AgentboltError, ValueError):
    """The request contradicts what is stored (e.g. a task id enqueued again with other data)."""

    status_code = 409


class Forbidden(AgentboltError, PermissionError):
    """The caller's credential does not allow this request (e.g. a worker token naming
    another worker)."""

    status_code = 403


class WorkerRevoked(AgentboltError, PermissionError):
    """The worker was revoked by an admin: its token no longer works, and no token may claim or
    renew work under its id. A runner that gets this stops (its running attempts were ended at
    the revocation and their rollouts moved on)."""

    status_code = 401


class WorkerTokenExpired(AgentboltError, PermissionError):
    """The worker token went unused for longer than the server's ``worker_token_ttl``; the runner
    registers again with the token it enrolled with, and goes on as a new worker."""

    status_code = 401


class InvalidInput(AgentboltError, ValueError):
    """The request is well formed but its content cannot be accepted (e.g. a score outside the
    reward's scale): answered 422, like a body that does not match the schema."""

    status_code = 422


class IdempotencyKeyReused(InvalidInput):
    """An ``Idempotency-Key`` sent again with another request (another body, or another object
    than the one it first named): a key names one logical call, so the server answers neither
    the first call's result nor any part of it."""


class QuotaExceeded(AgentboltError, RuntimeError):
    """An attempt's agent went over one of its quotas (events, bytes of events, model calls):
    429 for a count, 413 for bytes; the message names the limit and its value. The attempt
    goes on running; only this request was refused."""

    status_code = 429

    def __init__(self, message: str, status_code: int = 429) -> None:
        super().__init__(message)
        self.status_code = status_code


class ConfigError(AgentboltError, ValueError):
    status_code = 400


class StoreUnavailable(AgentboltError, ConnectionError):
    """The store's database cannot be opened or reached (bad path, database down)."""

    status_code = 503


class ServerUnavailable(AgentboltError, ConnectionError):
    """The server could not be reached after all retries."""

    status_code = 503


class ServerFailed(ServerUnavailable):
    """The server answered HTTP 500 to every try of one request (``RetryPolicy.server_errors``
    of them): it fails on this request, so sending it again would not help. The message holds
    the server's last answer."""

    status_code = 500


class MissingExtra(AgentboltError, ImportError):
    """A feature needs an optional part of agentbolt that this install lacks.

    ``pip install agentbolt`` is the runner and client only; the server, PostgreSQL and training
    come with the extras named here."""

    def __init__(self, what: str, extras: tuple[str, ...], missing: str | None = None) -> None:
        quoted = " and ".join(f"'{e}'" for e in extras)
        noun = "extra" if len(extras) == 1 else "extras"
        why = f" ({missing} is not installed)" if missing else ""
        install = f"pip install 'agentbolt[{','.join(extras)}]'"
        super().__init__(f"{what} needs the {quoted} {noun}{why}: {install}", name=missing)
        self.what, self.extras = what, extras
