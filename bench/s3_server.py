"""moto's S3 server as a stand-in store for the cloud benchmarks (bench_cloud.py, bench_cloud_train.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_s3_server(port: int, log_path: Path | None = None, pin: bool = False) -> subprocess.Popen:
    """moto's S3 server in its own process at nice 19; returns once it accepts connections.

    In real use the store is another machine, so the stand-in gets the lowest CPU priority
    (and, with `pin`, every core but the first, which training keeps).
    """

    def lower_priority():
        os.nice(19)
        if pin:
            os.sched_setaffinity(0, set(range(1, os.cpu_count())))

    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=lower_priority,
    )
    if log_path:
        log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"moto server exited with {server.returncode}" + (f"; see {log_path}" if log_path else ""))
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("moto server did not start within 60 s")
