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

Frames are a 4-byte big-endian length and a pickle. Both ends prove they hold the replica's
token (random, handed out only through a Serve call) before either unpickles anything: the client
sends a nonce and an HMAC of it under the token (a fixed-size raw read, so an unauthenticated peer
cannot make the replica buffer more), the replica answers with another HMAC of the nonce, which a
process that took over the replica's port cannot make. Then the client sends its sender's name.
The token and the traffic are not encrypted: run lanes only on a network you trust as you trust
Ray's own ports, or turn them off.
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


_NONCE_BYTES = 16
_MAC_BYTES = 32


def _mac(token: bytes, nonce: bytes, side: bytes) -> bytes:
    return hmac.new(token, side + nonce, "sha256").digest()


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """A peer that vanishes (its node lost, no FIN) is noticed within about half a minute, not TCP's 15 minutes."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 30_000)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


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
        self._starting: asyncio.Future | None = None
        self._lanes: set[asyncio.StreamWriter] = set()  # accepted, open
        self.address: LaneAddress | None = None

    async def start(self, host: str | None = None) -> LaneAddress:
        """Listen (once: later calls, concurrent ones too, get the same address)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start(host))
        return await asyncio.shield(self._starting)

    async def _start(self, host: str | None) -> LaneAddress:
        host = host or node_host()
        token = secrets.token_bytes(16)
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._accept, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = LaneAddress(host, port, token)
        return self.address

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(reader.readexactly(_NONCE_BYTES + _MAC_BYTES), CONNECT_TIMEOUT_S)
            nonce, mac = hello[:_NONCE_BYTES], hello[_NONCE_BYTES:]
            if not hmac.compare_digest(mac, _mac(self.address.token, nonce, b"client")):
                raise LaneError("a lane presented a wrong token")
            writer.write(_mac(self.address.token, nonce, b"server"))
            sender = await asyncio.wait_for(read_message(reader), CONNECT_TIMEOUT_S)
            if not isinstance(sender, str):
                raise LaneError(f"a lane named no sender (got {type(sender).__name__})")
        except (LaneError, asyncio.IncompleteReadError, TimeoutError, ConnectionError, pickle.UnpicklingError) as error:
            logger.warning("refused a lane from %s: %s", writer.get_extra_info("peername"), error)
            writer.close()
            return
        no_delay(writer)
        keep_alive(writer)
        self._lanes.add(writer)
        try:
            await self._on_lane(sender, reader, writer)
        finally:
            self._lanes.discard(writer)

    def close(self) -> None:
        """Stop accepting lanes and close the open ones (from any thread)."""
        server, self._server = self._server, None
        if server is None:
            return

        def close_all():
            server.close()
            for writer in list(self._lanes):
                writer.close()

        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop or self._loop.is_closed():
            close_all()
        else:
            self._loop.call_soon_threadsafe(close_all)


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
        try:
            nonce = secrets.token_bytes(_NONCE_BYTES)
            writer.write(nonce + _mac(address.token, nonce, b"client"))
            answer = await asyncio.wait_for(reader.readexactly(_MAC_BYTES), CONNECT_TIMEOUT_S)
            if not hmac.compare_digest(answer, _mac(address.token, nonce, b"server")):
                raise LaneError(f"the peer at {address.host}:{address.port} is not replica {replica}")
        except BaseException:
            writer.close()
            raise
        no_delay(writer)
        keep_alive(writer)
        writer.write(pack(sender))
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
