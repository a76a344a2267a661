"""Every error mstar raises: one root, flat and precisely named subclasses."""

from __future__ import annotations

__all__ = [
    "ActorDeadError",
    "ActorNotFoundError",
    "ActorNameTakenError",
    "ActorHandlerError",
    "MailboxFullError",
    "AskTimeoutError",
    "TransportClosedError",
    "PeerLostError",
    "ProtocolError",
    "MessageTooLargeError",
    "InvalidAddressError",
    "MStarError",
    "WorkerLostError",
    "WorkerUnavailableError",
    "MissingMainGuardError",
    "ModelLoadError",
    "EngineClosedError",
    "RequestAbortedError",
    "RequestStalledError",
    "PlacementError",
    "RayClusterUnreachableError",
    "GraphValidationError",
    "WalkDeadlockError",
    "WalkExecutionError",
    "BenchConfigError",
    "BenchTargetError",
    "InvalidSamplingParamsError",
    "InvalidRequestError",
    "RequestNotFoundError",
    "DuplicateRequestError",
    "KVCacheCapacityError",
    "CheckpointError",
    "UnsupportedModelError",
    "AudioTokenError",
    "ServerConfigError",
    "RunArgumentError",
    "APIRequestError",
    "OverloadedError",
    "ClientDisconnectedError",
    "RolloutStateError",
    "UntrustedModelError",
]


class MStarError(Exception):
    """Root of every error raised by mstar."""


class GraphValidationError(MStarError, ValueError):
    """Raised when a `ModelGraph` (nodes, edges, walks, partitions) is inconsistent."""


class WalkExecutionError(MStarError, RuntimeError):
    """Raised when a node fails while a walk runs; names the node, walk and request."""

    def __init__(
        self, message: str, *, node: str, walk: str, request_id: str, cause: str = ""
    ) -> None:
        super().__init__(f"{message} (node {node!r}, walk {walk!r}, request {request_id!r})")
        self.reason = message
        self.node = node
        self.walk = walk
        self.request_id = request_id
        self.cause = cause  # the class name of the node's own error ("" when none)


class BenchConfigError(MStarError, ValueError):
    """Raised when a benchmark's load, requests, targets or output options are invalid."""


class BenchTargetError(MStarError, RuntimeError):
    """Raised when a benchmark target answers with an error or a malformed response."""


class WalkDeadlockError(MStarError, RuntimeError):
    """Raised when every unfinished partition of a request waits for a stream chunk that cannot
    come."""


class InvalidSamplingParamsError(MStarError, ValueError):
    """Raised when a request's `SamplingParams` or `AttentionMask` hold an out-of-range value."""


class InvalidRequestError(MStarError, ValueError):
    """Raised when a request's field has the wrong type or is out of range; ``param`` names it."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestNotFoundError(MStarError, KeyError):
    """Raised when an engine is asked about a request id it does not hold."""


class DuplicateRequestError(MStarError, ValueError):
    """Raised when an engine is given a request id that it already holds."""


class KVCacheCapacityError(MStarError, ValueError):
    """Raised when a request can never fit the KV cache (too long for its blocks or max length)."""


class CheckpointError(MStarError, ValueError):
    """Raised when a checkpoint directory lacks files or holds missing or unexpected tensors."""


class UnsupportedModelError(MStarError, ValueError):
    """Raised when a model config asks for an architecture feature mstar does not implement."""


class ActorDeadError(MStarError, RuntimeError):
    """Raised when a message targets an actor that stopped or never existed, or was queued when it
    stopped."""


class ActorNotFoundError(MStarError, LookupError):
    """Raised when `ActorSystem.lookup` finds no actor under the given name at the given address."""


class ActorNameTakenError(MStarError, ValueError):
    """Raised when `ActorSystem.spawn` is given a name that a running actor already holds."""


class ActorHandlerError(MStarError, RuntimeError):
    """Raised at the asker when the actor's handler raised; names the original exception type."""

    def __init__(self, message: str, *, error_type: str = "Exception") -> None:
        super().__init__(message)
        self.error_type = error_type


class MailboxFullError(MStarError, RuntimeError):
    """Raised when a message is sent to an actor whose bounded mailbox is full."""


class AskTimeoutError(MStarError, TimeoutError):
    """Raised when `ActorRef.ask` gets no reply within its timeout."""


class TransportClosedError(MStarError, ConnectionError):
    """Raised when a channel, listener or actor system is used after it was closed."""


class PeerLostError(MStarError, ConnectionError):
    """Raised when a peer actor system disconnects or misses its heartbeats (its process died)."""


class ProtocolError(MStarError, ValueError):
    """Raised when frames do not decode into a valid wire message, or a message is not part of the
    protocol."""


class MessageTooLargeError(MStarError, ValueError):
    """Raised when an encoded message exceeds the link's `max_message_bytes`."""


class InvalidAddressError(MStarError, ValueError):
    """Raised when a transport address is malformed, has an unknown scheme or binds a non-loopback
    host without opt-in."""


class PlacementError(MStarError, ValueError):
    """Raised when a placement file is missing, malformed, or does not fit the model's graph."""


class RayClusterUnreachableError(MStarError, ConnectionError):
    """Raised when the Ray cluster an engine is told to use cannot be reached or joined in time
    (names the address)."""


class EngineClosedError(MStarError, RuntimeError):
    """Raised when work is submitted to, or still pending in, an engine that has closed."""


class RequestAbortedError(MStarError, RuntimeError):
    """Raised when a request's pending work is dropped because the request was aborted."""


class RequestStalledError(MStarError, RuntimeError):
    """Raised when a request made no progress for `EngineConfig.request_stall_timeout_s` (e.g. a
    lost message); it is failed and freed."""


class ModelLoadError(MStarError, RuntimeError):
    """Raised when a model, its factory or its checkpoint cannot be loaded."""


class UntrustedModelError(ModelLoadError):
    """Raised when a worker is asked to build a model whose factory is neither in the zoo nor
    allow-listed."""


class AudioTokenError(MStarError, ValueError):
    """Raised when a speech LM emits a token that is not a valid audio code for its frame
    position."""


class WorkerLostError(MStarError, RuntimeError):
    """Raised when a worker process died while a request was using it (the worker is restarted)."""


class WorkerUnavailableError(WorkerLostError):
    """Raised when a request needs a rank whose worker is down (restarting) and no live replica can
    take it; retryable (503 with Retry-After)."""

    def __init__(self, message: str, *, rank: int | None = None, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.rank = rank  # None when not known (an error rebuilt from a stream's text)
        self.retry_after_s = retry_after_s


class MissingMainGuardError(MStarError, RuntimeError):
    """Raised when worker processes are started from a script without an ``if __name__ ==
    "__main__":`` guard."""


class ServerConfigError(MStarError, ValueError):
    """Raised when server settings are invalid, e.g. a non-loopback bind without an API key."""


class RunArgumentError(MStarError, ValueError):
    """Raised when `mstar run`'s flags do not make a request the model takes (the message names the
    flag)."""


class APIRequestError(MStarError, ValueError):
    """Raised when an HTTP API request is invalid; carries the HTTP status and the offending
    field."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type


class OverloadedError(MStarError, RuntimeError):
    """Raised when the server's admission queue is full (answered 503 with Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClientDisconnectedError(MStarError, ConnectionError):
    """Raised when an HTTP client disconnects before its answer is complete."""


class RolloutStateError(MStarError, RuntimeError):
    """Raised when a world-model rollout step does not continue the frames its engine caches for the
    request."""
