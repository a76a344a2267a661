"""`SystemConfig`: the settings of an actor system, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from mstar.transport.curve import CurveKeys

__all__ = ["SystemConfig"]


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
