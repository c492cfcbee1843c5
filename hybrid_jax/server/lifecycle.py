"""The server process's life on uvicorn: header read timeouts, and a graceful drain on SIGTERM.

SIGTERM (or SIGINT) stops admission at once (new requests get 503, /health 503) and lets the
requests in flight finish for up to `shutdown_timeout_s`; at that deadline the streams still open
get an error event and `[DONE]`, non-streaming requests a 503, and uvicorn closes the connections.
The caller then shuts the engine down (the engine thread, the prefix store and its disk tier's
pending writes) and the process exits 0: the signal is handled, not re-raised as uvicorn does by
default. A second SIGINT forces an immediate exit.

A connection that does not finish sending its request headers within `header_timeout_s` is closed
(uvicorn has a keep-alive timeout between requests but none for headers); slow bodies are the
app's (ServerConfig.body_timeout_s, 408).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvicorn

try:                                  # httptools' C parser: a fraction of h11's cost per streamed event
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as BaseProtocol
except ImportError:                   # (httptools not installed: uvicorn's pure-Python h11)
    from uvicorn.protocols.http.h11_impl import H11Protocol as BaseProtocol

log = logging.getLogger("hybrid_jax.server")


def header_timeout_protocol(header_timeout_s: float) -> type:
    """uvicorn's HTTP protocol (httptools, else h11), closing connections whose request headers are
    not complete in time."""

    class Protocol(BaseProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()      # the next request on this connection gets the same limit

        def _arm_header_timer(self):
            armed_for = self.cycle            # a new request replaces the cycle once its headers are in

            def expire():
                waiting = self.cycle is armed_for and (self.cycle is None or self.cycle.response_complete)
                if waiting and not self.transport.is_closing():
                    log.info("closing a connection whose request headers did not arrive within %g s",
                             header_timeout_s)
                    self.transport.close()

            self.loop.call_later(header_timeout_s, expire)

    return Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains (see the module doc) instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, state, shutdown_timeout_s: float, on_drain=None):
        super().__init__(config)
        self.state, self.shutdown_timeout_s, self.on_drain = state, shutdown_timeout_s, on_drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        log.info("signal %d: draining (new requests get 503; %g s for the ones in flight)", sig,
                 self.shutdown_timeout_s)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.state.begin_drain, self.shutdown_timeout_s)
        if self.on_drain is not None:
            self.on_drain()
        self.should_exit = True


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other processes may bind too (SO_REUSEPORT: the kernel
    spreads new connections over them): how several API server processes share one port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def run(app, state, *, host: str, port: int, shutdown_timeout_s: float, header_timeout_s: float,
        keep_alive_timeout_s: float, on_server=None, sockets=None, on_drain=None):
    """Serves until a signal (drained) or `server.should_exit` (set by the loader when loading fails).
    sockets: listening sockets to serve on instead of binding host:port; on_drain: called when a
    signal starts the drain (the API server that owns others passes it on)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="info", http=header_timeout_protocol(header_timeout_s),
                            timeout_keep_alive=keep_alive_timeout_s,
                            # the drain deadline ends every request; this is only a backstop behind it
                            timeout_graceful_shutdown=shutdown_timeout_s + 5)
    server = DrainingServer(config, state, shutdown_timeout_s, on_drain)
    if on_server is not None:
        on_server(server)
    server.run(sockets=sockets)
    return server
