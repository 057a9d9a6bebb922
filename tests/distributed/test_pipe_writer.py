"""PipeWriter: messages arrive whole and in order, small ones leave from the caller, and a peer that does not read
never blocks the caller."""

import multiprocessing as mp
import threading

from pagedkv.distributed.pipe_writer import PipeWriter, inline_limit


def _drain(conn, count: int) -> list[bytes]:
    return [conn.recv_bytes() for _ in range(count)]


def test_small_messages_leave_from_the_caller_when_the_pipe_is_clear():
    ours, theirs = mp.Pipe()
    writer = PipeWriter(ours, "test-send")
    try:
        assert inline_limit(ours) > 0  # a Unix socket pair
        blobs = [bytes([i]) * 100 for i in range(20)]
        for blob in blobs:
            writer.send(blob)
            assert theirs.poll(5)  # written before send returned, or by the thread soon after
        assert _drain(theirs, len(blobs)) == blobs
        assert writer.num_inline == len(blobs)  # a reader keeps up: no message needed the thread
    finally:
        writer.close()
        writer.join(5)


def test_a_peer_that_does_not_read_never_blocks_the_caller_and_order_holds():
    """Several socket buffers' worth, large and small mixed, sent while nobody reads; then read back in order."""
    ours, theirs = mp.Pipe()
    writer = PipeWriter(ours, "test-send")
    blobs = [(b"L" if i % 7 == 6 else b"s") + i.to_bytes(4, "little") * (50_000 if i % 7 == 6 else 500)
             for i in range(400)]  # ~7 MB: far past any default socket buffer
    sender = threading.Thread(target=lambda: [writer.send(blob) for blob in blobs], daemon=True)
    sender.start()
    sender.join(timeout=60)
    blocked = sender.is_alive()
    received = _drain(theirs, len(blobs))  # unblocks a stuck sender before the assertion
    writer.close()
    writer.join(5)
    assert not blocked, "send() waited for a peer that was not reading"
    assert received == blobs
    assert 0 < writer.num_inline < len(blobs)  # the first ones left at once, the rest queued behind the thread


def test_a_closed_peer_makes_sends_no_ops():
    ours, theirs = mp.Pipe()
    writer = PipeWriter(ours, "test-send")
    theirs.close()
    for _ in range(5):
        writer.send(b"x" * 100)  # must not raise
    writer.send(b"y" * (1 << 20))
    writer.close()
    writer.join(5)


def test_a_pipe_that_is_not_a_socket_always_uses_the_thread():
    ours, theirs = mp.Pipe(duplex=False)  # an os.pipe: its free space is not known, so nothing is written inline
    writer = PipeWriter(theirs, "test-send")
    try:
        assert inline_limit(theirs) == 0
        writer.send(b"abc")
        assert ours.poll(5) and ours.recv_bytes() == b"abc"
        assert writer.num_inline == 0
    finally:
        writer.close()
        writer.join(5)
