"""ZeroMQ CURVE on tcp links: encrypted, and only peers holding the deployment's keys.

A CURVE server socket proves it holds the server secret; on its own it would accept any
client that knows the (public) server key. A ZAP handler (pyzmq's authenticator, on a thread
of its own so that a busy event loop never stalls a handshake) admits only clients whose
public key a listener registered, the deployment's client key. One handler serves every
socket of the process's ZeroMQ context.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth.thread

__all__ = ["ZAP_DOMAIN", "CurveKeys", "secure_client", "secure_server"]

ZAP_DOMAIN = "mstar"


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
        return cls(
            server_public.decode(),
            server_secret.decode(),
            client_public.decode(),
            client_secret.decode(),
        )

    def __repr__(self) -> str:
        return (
            f"CurveKeys(server_public={self.server_public!r}, "
            f"client_public={self.client_public!r}, secrets hidden)"
        )


class _ClientKeys:
    """The ZAP credentials check: admit registered client keys (Z85), deny the rest."""

    def __init__(self) -> None:
        self.allowed: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


_lock = threading.Lock()
_auth: zmq.auth.thread.ThreadAuthenticator | None = None
_keys = _ClientKeys()


def _admit(client_public: str) -> None:
    global _auth
    with _lock:
        _keys.allowed.add(client_public.encode())
        if _auth is None:
            auth = zmq.auth.thread.ThreadAuthenticator(zmq.Context.instance())
            auth.start()
            auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_keys)
            _auth = auth


def secure_server(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make a socket about to bind a CURVE server admitting only the deployment's clients."""
    _admit(keys.client_public)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret.encode())


def secure_client(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make a socket about to connect a CURVE client of the deployment's servers."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret.encode())
