"""An idle keep-alive connection is closed by the client first, never by the server under it."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx


def _get(sock: socket.socket, host: str) -> bytes:
    sock.sendall(f"GET /health HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0]


def test_a_connection_idle_longer_than_clients_keep_theirs_is_still_served(server):
    # httpx (and the OpenAI client built on it) reuse an idle connection for up to 5 s: the
    # server must keep it longer, or a request sent as the server closes it fails unread
    assert httpx.Limits().keepalive_expiry == 5.0
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        assert _get(sock, parts.netloc) == b"HTTP/1.1 200 OK"
        time.sleep(6.5)  # past uvicorn's default keep-alive (5 s)
        assert _get(sock, parts.netloc) == b"HTTP/1.1 200 OK"
