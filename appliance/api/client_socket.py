"""The client's socket as a generation's HTTP worker sees it: has the peer gone (its generation is then cancelled),
and a small send buffer for a streamed answer."""

from __future__ import annotations

import errno
import select
import socket

# Kernel send buffer of a streaming response (Linux doubles it): what a client that stopped reading can leave unread
# before the worker's send timeout starts counting (appliance/http/worker.py).
STREAM_SEND_BUFFER = 16 * 1024

POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)  # Linux: the peer shut down its writing side


def socket_closed(sock: socket.socket | None) -> bool:
    """True when the peer closed (its FIN, or a reset). Pipelined request bytes mean it is alive, unless it closed
    behind them.

    `poll`, not `select` (which cannot take an fd >= 1024), and only then a peek at the raw socket (TLS too): on a
    socket with a timeout (`--send-timeout`) Python waits for readability before a `recv`, even with MSG_DONTWAIT.
    The peer's FIN is also seen behind bytes it sent before it (POLLRDHUP): a TLS client's close_notify alert, or
    anything unread, would otherwise hide it from the peek for as long as the request runs (a client that closes
    this way left its generation running to the end). An error we do not expect means "alive": cancelling a live
    client's generation is worse than noticing a gone one late."""
    if sock is None:
        return False
    try:
        fd = sock.fileno()
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN | POLLRDHUP)
        events = poller.poll(0)
        if not events:
            return False
        if events[0][1] & (POLLRDHUP | select.POLLHUP):
            return True
        # the kernel's bytes, not the TLS layer's (an SSLSocket refuses MSG_PEEK): FIN reads as b"" either way
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError, TimeoutError):
        return False
    except (ConnectionError, OSError) as exc:
        return isinstance(exc, ConnectionError) or exc.errno in (errno.ENOTCONN, errno.EBADF)
    except Exception:
        return False


def bound_send_buffer(sock: socket.socket | None) -> None:
    """A small kernel send buffer for a streaming response, so a client that stopped reading blocks our writes (and
    meets the worker's send timeout) after STREAM_SEND_BUFFER bytes or so, not after megabytes of autotuned buffer
    while its generation goes on. Token events are small: this costs a reading client nothing."""
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
        except OSError:
            pass
