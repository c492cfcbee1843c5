"""The server process's life on uvicorn: header read timeouts and size limit, and a graceful drain on SIGTERM.

SIGTERM (or SIGINT) stops admission at once (new requests get 503, /health 503) and lets the
requests in flight finish for up to `shutdown_timeout_s`; at that deadline the streams still open
get an error event and `[DONE]`, non-streaming requests a 503, and uvicorn closes the connections.
The caller then shuts the engine down (the engine thread, the prefix store and its disk tier's
pending writes) and the process exits 0: the signal is handled, not re-raised as uvicorn does by
default. A second SIGINT forces an immediate exit.

A connection that does not finish sending its request headers within `header_timeout_s` is closed
(uvicorn has a keep-alive timeout between requests but none for headers); slow bodies are the
app's (ServerConfig.body_timeout_s, 408).

Request headers (the request line included) are limited to `max_header_bytes` (default 64 KiB,
`--max-header-bytes`; nginx's large_client_header_buffers allow 4 x 8 KiB, Node 16 KiB), counted
as they arrive: once a request's headers pass the limit, before they are complete, it is answered
431 in OpenAI's error shape and its connection closed, so the parser never holds more than the
limit and one read (at most 256 KiB) of them. Headers that arrived whole in one read are measured
when the parser completes them, and refused the same way before the app sees the request. (With
h11 instead of httptools, uvicorn's own `h11_max_incomplete_event_size` is set to the limit and
answers 400.) The connection is then closed: at once for writing, for reading after
REFUSED_LINGER_S, what arrives meanwhile dropped unparsed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket

import uvicorn

try:                                  # httptools' C parser: a fraction of h11's cost per streamed event
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as BaseProtocol
except ImportError:                   # (httptools not installed: uvicorn's pure-Python h11)
    from uvicorn.protocols.http.h11_impl import H11Protocol as BaseProtocol

log = logging.getLogger("hybrid_jax.server")


MAX_HEADER_BYTES = 64 << 10
REFUSED_LINGER_S = 1.0        # a connection answered 431 is closed this long after the answer


def _header_431(limit: int) -> bytes:
    body = json.dumps({"error": {"message": f"the request headers exceed the limit of {limit} bytes",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "request_header_fields_too_large"}}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def server_protocol(header_timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES, on_refused=None) -> type:
    """uvicorn's HTTP protocol (httptools, else h11), closing connections whose request headers are
    not complete in time, and answering 431 to headers over `max_header_bytes` (see the module doc);
    on_refused(): called for each 431 (to count it)."""
    counts_headers = hasattr(BaseProtocol, "on_headers_complete")      # httptools' parser callbacks

    class Protocol(BaseProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._header_bytes = 0         # of the request whose headers are arriving
            self._in_headers = True        # between requests and until the parser completes the headers
            self._refused = False          # answered 431: whatever else arrives is dropped
            self._arm_header_timer()

        def data_received(self, data: bytes):
            if self._refused:          # (lingering after a 431: dropped)
                return
            if counts_headers and self._in_headers:
                self._header_bytes += len(data)
            super().data_received(data)
            # still in the headers after this read: every byte counted belongs to them
            if counts_headers and self._in_headers and self._header_bytes > max_header_bytes:
                self._refuse_headers()

        def on_headers_complete(self):
            self._in_headers = False
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > max_header_bytes:    # arrived within one read: measured whole
                self._refuse_headers()
                return                     # no request cycle: the app never sees it
            super().on_headers_complete()

        def on_body(self, body: bytes):
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self):
            if self._refused:
                return
            super().on_message_complete()
            self._header_bytes, self._in_headers = 0, True     # the next request on this connection

        def _refuse_headers(self):
            self._refused = True
            log.info("answering 431 to request headers over %d bytes, closing the connection", max_header_bytes)
            if on_refused is not None:
                on_refused()
            t = self.transport
            if t.is_closing():
                return
            t.write(_header_431(max_header_bytes))
            if t.can_write_eof():
                # a lingering close (as nginx's): the answer and our FIN go out, what the client still
                # sends is read and dropped for a moment, so its kernel gets no reset that could
                # discard the 431 before the client reads it; then the connection closes
                t.write_eof()
                self.loop.call_later(REFUSED_LINGER_S, t.close)
            else:
                t.close()

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
        keep_alive_timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES, on_server=None, sockets=None,
        on_drain=None):
    """Serves until a signal (drained) or `server.should_exit` (set by the loader when loading fails).
    sockets: listening sockets to serve on instead of binding host:port; on_drain: called when a
    signal starts the drain (the API server that owns others passes it on)."""
    metrics = getattr(state, "metrics", None)       # the API server's own counters (server/api_metrics.py)
    on_refused = None if metrics is None else lambda: metrics.count_error("invalid_request_error")
    protocol = server_protocol(header_timeout_s, max_header_bytes, on_refused=on_refused)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", http=protocol,
                            h11_max_incomplete_event_size=max_header_bytes,
                            timeout_keep_alive=keep_alive_timeout_s,
                            # the drain deadline ends every request; this is only a backstop behind it
                            timeout_graceful_shutdown=shutdown_timeout_s + 5)
    server = DrainingServer(config, state, shutdown_timeout_s, on_drain)
    if on_server is not None:
        on_server(server)
    server.run(sockets=sockets)
    return server
