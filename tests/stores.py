"""The stand-in S3 store of the tests: moto's S3 server on 127.0.0.1 (the fixtures `moto_server` and `s3_url`
are conftest.py's), and the fake credentials no output may show."""

from __future__ import annotations

from ports import free_port

ACCESS_KEY = "AKIAFAKE0TEST0KEY0ID"
SECRET_KEY = "sEcReT/do-not-print-0123456789abcdef"


class MotoServer:
    """moto's S3 server in a thread; stop() and start() again on the same port keep its data."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self._cls = ThreadedMotoServer
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = None

    def start(self):
        self.server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self):
        self.server.stop()
