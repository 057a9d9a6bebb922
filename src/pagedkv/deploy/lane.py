"""Lanes: one TCP connection from an ingress's engine client to one engine replica, beside Ray Serve's calls.

A Ray Serve handle call costs a request 2-3 ms before its replica sees it (the handle's router,
Serve's gRPC hop, the replica's request wrapper), and that is most of what the Ray app adds to a
first token over `pagedkv serve`. A lane carries the request there in one TCP write instead:

    ingress (RayEngineClient)                        engine replica (EngineReplica)
    ("add", wire_id, token_ids, params, hashes) ──►  the request starts at once (its outbox is the sender's)
    ("abort", wire_id)                          ──►  aborted, its blocks freed
    ("attach",)                                 ──►  this lane becomes the sender's output reader
    (packed messages, load) items               ◄──  what `outputs` would have streamed, in the same form

The Serve call still goes out for every request, pinned to the lane's replica, and stays open
until the request ends: Ray Serve's count of ongoing requests (autoscaling, draining) and a
client's cancellation keep working as they do without lanes, and a lane that loses a request's
message loses nothing, since the call carries the same request (the replica runs each id once).

Frames are a 4-byte big-endian length and a pickle. The first frame a client sends is the
replica's token (random, handed out only through a Serve call), read as raw bytes before anything
is unpickled; a connection with a wrong token is closed. The second is the sender's name.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import socket
import struct
from dataclasses import dataclass

from pagedkv.errors import PagedKVError

logger = logging.getLogger("pagedkv.deploy")

_LENGTH = struct.Struct("!I")
#: The largest frame a lane reads (a replica's output items stay near `replica.MAX_ITEM_BYTES`).
MAX_FRAME_BYTES = 256 << 20
#: How long a client waits for a lane to connect.
CONNECT_TIMEOUT_S = 5.0


class LaneError(PagedKVError):
    """A lane's peer broke the protocol (a frame over `MAX_FRAME_BYTES`, a wrong token)."""


@dataclass(frozen=True)
class LaneAddress:
    """Where a replica's lanes connect, and the token they must present."""

    host: str
    port: int
    token: bytes


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def pack(message) -> bytes:
    return frame(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's payload, or None at a clean end of the stream."""
    try:
        header = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as error:
        if error.partial:
            raise
        return None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise LaneError(f"a lane frame of {length} bytes is over the limit of {MAX_FRAME_BYTES}")
    return await reader.readexactly(length)


async def read_message(reader: asyncio.StreamReader):
    payload = await read_frame(reader)
    return None if payload is None else pickle.loads(payload)


def no_delay(writer: asyncio.StreamWriter) -> None:
    """Small writes go out at once (asyncio's loop sets it on TCP sockets; uvloop's may not)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def node_host() -> str:
    """This node's address as Ray knows it (127.0.0.1 outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in a Ray worker: loopback will do
        pass
    return "127.0.0.1"


class LaneServer:
    """The replica's end: accepts lanes on the running loop and hands each one to `on_lane(sender, reader,
    writer)` once it presented the token and its sender's name."""

    def __init__(self, on_lane):
        self._on_lane = on_lane
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.address: LaneAddress | None = None

    async def start(self, host: str | None = None) -> LaneAddress:
        host = host or node_host()
        token = secrets.token_bytes(16)
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._accept, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = LaneAddress(host, port, token)
        return self.address

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(read_frame(reader), CONNECT_TIMEOUT_S)
            if token is None or not hmac.compare_digest(token, self.address.token):
                raise LaneError("a lane presented a wrong token")
            sender = await asyncio.wait_for(read_message(reader), CONNECT_TIMEOUT_S)
            if not isinstance(sender, str):
                raise LaneError(f"a lane named no sender (got {type(sender).__name__})")
        except (LaneError, asyncio.IncompleteReadError, TimeoutError, ConnectionError, pickle.UnpicklingError) as error:
            logger.warning("refused a lane from %s: %s", writer.get_extra_info("peername"), error)
            writer.close()
            return
        no_delay(writer)
        await self._on_lane(sender, reader, writer)

    def close(self) -> None:
        """Stop accepting lanes (from any thread)."""
        server, self._server = self._server, None
        if server is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop or self._loop.is_closed():
            server.close()
        else:
            self._loop.call_soon_threadsafe(server.close)


class LaneClient:
    """The ingress's end of one lane: `send` writes a message at once (no wait); `messages()` yields what the
    replica sends back until the lane ends."""

    def __init__(self, replica: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.replica = replica
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(cls, replica: str, address: LaneAddress, sender: str) -> "LaneClient":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port),
                                                CONNECT_TIMEOUT_S)
        no_delay(writer)
        writer.write(frame(address.token) + pack(sender))
        return cls(replica, reader, writer)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def send(self, message) -> bool:
        """Write `message`; False if the lane is closed (the caller falls back on the Serve call)."""
        if self._writer.is_closing():
            return False
        try:
            self._writer.write(pack(message))
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def messages(self):
        while (message := await read_message(self._reader)) is not None:
            yield message

    def close(self) -> None:
        self._writer.close()
