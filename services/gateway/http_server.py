"""The gateway's HTTP server: uvicorn on the gateway's event loop, with a deadline on request heads and no signal
handling of its own (the gRPC server owns SIGTERM). What it serves is http.py's HttpFront (the OpenAI API)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.http import HttpFront

HTTP_IDLE_S = 10.0  # a connection must send a request's headers within this long of opening, or of its last response


class _H11(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on request heads: a connection that has not sent a complete head
    within HTTP_IDLE_S of opening (or of its last response) is closed. uvicorn alone waits forever for one (any
    byte received disarms its keep-alive timer): 5,000 half-sent requests once stayed open."""

    head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(HTTP_IDLE_S, self._head_timeout)

    def _head_timeout(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no complete head yet
            self.transport.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway's gRPC server owns SIGTERM and stops this one."""

    def capture_signals(self):
        return contextlib.nullcontext()


def http_server(front: HttpFront, host: str, port: int, tls: tuple[str, str] | None = None
                ) -> tuple[_Uvicorn, socket.socket]:
    """A uvicorn server for the front on the running loop, and its bound socket (port 0 = any free port); HTTPS
    when tls gives (key file, certificate file)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    key, cert = tls or (None, None)
    server = _Uvicorn(uvicorn.Config(front.app, log_level="warning", lifespan="off", http=_H11,
                                     timeout_keep_alive=HTTP_IDLE_S, ssl_keyfile=key, ssl_certfile=cert))
    return server, sock
