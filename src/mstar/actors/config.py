"""`SystemConfig`: the settings of an actor system, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

__all__ = ["CurveKeys", "SystemConfig"]


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The ZeroMQ CURVE keys of one deployment (Z85 text), shared by all its actor systems.

    Every system serves tcp with the server key pair and connects with the client key pair;
    a server accepts only clients that present ``client_public`` (checked by a ZAP handler),
    and a client talks only to a server that proves it holds ``server_secret``. A peer without
    the keys cannot open a link, and what crosses a link is encrypted. Generated at start
    (`generate`) and handed to workers with their launch, never sent in a message.
    """

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> CurveKeys:
        """Return fresh random key pairs."""
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public.decode(), server_secret.decode(), client_public.decode(), client_secret.decode())

    def __repr__(self) -> str:
        return f"CurveKeys(server_public={self.server_public!r}, client_public={self.client_public!r}, secrets hidden)"


@dataclass(frozen=True, slots=True)
class SystemConfig:
    """Settings of an actor system (validated on construction).

    Attributes:
        mailbox_size: default mailbox capacity of spawned actors.
        heartbeat_interval_s: a link idle for this long sends a heartbeat.
        heartbeat_timeout_s: a link silent for this long is lost; bounds how long asks to a
            dead process wait. A peer on this host is not lost for silence but once its
            process exited (seen within a heartbeat interval; see `mstar.actors.link`).
        max_message_bytes: largest message a link sends or accepts (frames together).
        shm_arena_bytes: size of this system's shared tensor arena; 0 disables shared memory.
        shm_min_tensor_bytes: smaller CPU tensors travel as frames.
        allow_remote: let `serve` bind TCP on non-loopback interfaces.
        stop_timeout_s: how long `stop` waits for a busy actor before cancelling it.
        curve: CURVE keys for every tcp link this system serves or opens (None: plain tcp).
        host_id: what tells this system's host apart, for shared memory and CUDA IPC with
            peers (None: the machine's boot); systems in one machine that should act as
            separate hosts (Ray nodes of one test cluster) get different ones.
    """

    mailbox_size: int = 1024
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    max_message_bytes: int = 1 << 30
    shm_arena_bytes: int = 256 << 20
    shm_min_tensor_bytes: int = 64 << 10
    allow_remote: bool = False
    stop_timeout_s: float = 10.0
    curve: CurveKeys | None = None
    host_id: str | None = None

    def __post_init__(self) -> None:
        if self.mailbox_size < 1:
            raise ValueError(f"mailbox_size must be >= 1, got {self.mailbox_size}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(
                "need 0 < heartbeat_interval_s < heartbeat_timeout_s, got "
                f"{self.heartbeat_interval_s} and {self.heartbeat_timeout_s}"
            )
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.shm_arena_bytes < 0 or self.shm_min_tensor_bytes < 1:
            raise ValueError("shm_arena_bytes must be >= 0 and shm_min_tensor_bytes >= 1")
        if self.stop_timeout_s < 0:
            raise ValueError(f"stop_timeout_s must be >= 0, got {self.stop_timeout_s}")
