"""A free TCP port on 127.0.0.1, for the tests' servers and process groups (moto's S3, gloo's rendezvous)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
