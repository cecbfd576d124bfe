"""uvicorn's HTTP/1.1 protocol (h11) with the timeout it lacks: a client that opens a connection (or keeps one open
after an answer) must send a whole request head within `header_timeout` seconds of its first byte or of connecting,
or the connection is closed, with one line in the log. Without it a client sending its headers a byte a minute
(slowloris) holds a connection, and one of --max-connections, forever. uvicorn's keep-alive timeout covers an idle
connection between requests; a body's pauses are timed by the app (openai_api.read_limited: 408)."""

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0  # a request head must be whole this long after the connection opens or its first byte
BODY_TIMEOUT_S = 30.0  # the longest pause within a request body (openai_api.read_limited)


class TimedH11Protocol(H11Protocol):
    header_timeout = HEADER_TIMEOUT_S  # (timed_protocol makes the class with another)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm()  # a head begun and not whole yet: it has until the timer
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.header_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            client = "%s:%d" % self.client if self.client else "a client"
            print(f"note: {client} sent no whole request head in {self.header_timeout:g} s (--header-timeout); its "
                  "connection is closed", flush=True)
            self.transport.close()


def timed_protocol(header_timeout: float) -> type:
    """The protocol class for uvicorn.Config(http=...) with `header_timeout` seconds for a request head."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": float(header_timeout)})
