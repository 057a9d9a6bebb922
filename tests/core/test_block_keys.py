"""A prompt is hashed once: keys a router computed are reused by the block manager and the scheduler."""

from pagedkv.core.block_manager import KVBlockManager
import hashlib
import struct

from pagedkv.core.prefix_cache import block_keys, hash_block, hash_blocks
from pagedkv.distributed.router import prompt_block_hashes

BLOCK_SIZE = 4
PROMPT = list(range(10, 30))  # 20 tokens: 5 full blocks, of which 4 can hit (the last token is computed)


def test_block_keys_reuses_known_keys_and_hashes_the_rest():
    real = hash_blocks(PROMPT, BLOCK_SIZE)
    assert block_keys(PROMPT, BLOCK_SIZE) == real
    assert block_keys(PROMPT, BLOCK_SIZE, real[:2]) == real  # the rest chained from the last known key
    marked = [b"k" * 32, b"j" * 32]
    keys = block_keys(PROMPT, BLOCK_SIZE, marked)
    assert keys[:2] == marked and keys[2] == hash_blocks(PROMPT[8:12], BLOCK_SIZE, marked[1])[0]
    assert block_keys(PROMPT, BLOCK_SIZE, real, start=3, parent=real[2]) == real[3:]


def test_the_block_manager_caches_under_the_keys_it_was_given():
    # Keys no hash could produce: if they end up in the cache, the manager used them instead of hashing.
    given = [bytes([i]) * 32 for i in range(len(prompt_block_hashes(PROMPT, BLOCK_SIZE)))]
    bm = KVBlockManager(32, BLOCK_SIZE)
    assert bm.admit(1, PROMPT, known_keys=given) == 0
    bm.append_slots(1, len(PROMPT))
    bm.commit(1, PROMPT, len(PROMPT), known_keys=given)
    cached = set(bm.prefix_cache.recent_keys(100))
    last = hash_blocks(PROMPT[16:], BLOCK_SIZE, given[-1])  # the 5th block: hashed, chained from the given keys
    assert cached == set(given) | set(last)
    bm.free(1)
    # A second request with the same given keys hits all of them.
    assert bm.admit(2, PROMPT, known_keys=given) == len(given) * BLOCK_SIZE
    bm.free(2)
    bm.check_integrity()


def test_hash_blocks_is_the_documented_chain():
    """Keys are sha256(parent key || the block's tokens as little-endian int64), from 32 zero bytes: what a disk
    tier written by an earlier version was keyed by (its files must stay findable). A partial tail has no key."""
    tokens = [3, 70000, 2**40, 0, 5, 6, 7, 8, 9]
    expected, parent = [], b"\x00" * 32
    for start in (0, 4):
        parent = hashlib.sha256(parent + struct.pack("<4q", *tokens[start:start + 4])).digest()
        expected.append(parent)
    assert hash_blocks(tokens, 4) == expected
    assert [hash_block(None, tokens[:4]), hash_block(expected[0], tokens[4:8])] == expected
    assert hash_blocks(tokens[4:], 4, expected[0]) == expected[1:]
    assert hash_blocks(tokens[:3], 4) == []
