"""`TransportTally`: how many tensor bytes one actor system's links sent and received, by path.

A tensor crosses between actor systems in one of four ways, and each is counted under its own
kind when the link's codec encodes (sent) or decodes (received) a message:

| kind | what moves | counted bytes |
|---|---|---|
| `ipc`, `tcp` | a ZeroMQ frame over that socket scheme (copied through the kernel) | the frame |
| `shm` | a slot of the sender's shared arena (written once, viewed zero-copy) | the slot |
| `cuda_ipc` | CUDA IPC handles (the receiver maps the sender's GPU memory) | the tensor's bytes |

Only tensor payloads count, not message headers. Links between actor systems of one process
(`inproc://`) and actors of one system pass tensors by reference: no bytes move there, and
nothing is counted. The counters are plain ints bumped on the event loop's thread, once per
message that carries tensors: no locks, nothing allocated per message.
"""

from __future__ import annotations

__all__ = ["CUDA_IPC", "SHM", "TRANSPORT_KINDS", "TransportTally"]

SHM = "shm"
CUDA_IPC = "cuda_ipc"
# The kinds every tally lists (zero until used); a codec for another scheme adds its own.
TRANSPORT_KINDS: tuple[str, ...] = ("ipc", "tcp", SHM, CUDA_IPC)


class TransportTally:
    """Cumulative tensor bytes sent and received, per transport kind."""

    __slots__ = ("received", "sent")

    def __init__(self) -> None:
        self.sent: dict[str, int] = dict.fromkeys(TRANSPORT_KINDS, 0)
        self.received: dict[str, int] = dict.fromkeys(TRANSPORT_KINDS, 0)

    def add_kind(self, kind: str) -> None:
        """List ``kind`` (a transport scheme) so that counting under it never adds a key."""
        self.sent.setdefault(kind, 0)
        self.received.setdefault(kind, 0)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Return ``{kind: {"sent": bytes, "received": bytes}}`` for every listed kind."""
        return {
            kind: {"sent": self.sent[kind], "received": self.received[kind]} for kind in self.sent
        }
