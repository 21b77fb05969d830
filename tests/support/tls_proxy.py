"""A TLS front for a plaintext TCP service (stands in for a Redis built with TLS: the embedded one is not): it wants a
client certificate of the given CA and forwards bytes both ways to the target port."""

from __future__ import annotations

import asyncio
import ssl
import threading


class TLSProxy:
    def __init__(self, target_port: int, ca: str, cert: str, key: str):
        self.target_port = target_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
        self.context.load_cert_chain(cert, key)
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> TLSProxy:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self):
        return await asyncio.start_server(self._client, "127.0.0.1", 0, ssl=self.context)

    async def _client(self, reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
