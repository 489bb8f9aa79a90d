"""Block pool bookkeeping: allocation, reference counts, prefix caching with LRU reuse."""

import pytest

from appliance.runtime.kv_cache import BlockPool, chain_hash


def test_allocate_free_and_exhaustion():
    pool = BlockPool(4, 8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.fork(a[:1])
    pool.free(a)
    assert pool.num_free == 3  # a[0] still held by the fork
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.free(a[:1])


def _fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """What the scheduler does for a computed prompt: allocate, then name every full block."""
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    parent = None
    for j in range(len(tokens) // pool.block_size):
        parent = pool.register(blocks[j], parent, tuple(tokens[j * 4 : (j + 1) * 4]))
    return blocks


def test_prefix_match_reuses_full_blocks_and_leaves_one_token():
    pool = BlockPool(8, 4, prefix_caching=True)
    prompt = list(range(10))  # blocks [0-3] [4-7] and a partial [8, 9]
    blocks = _fill(pool, prompt)
    pool.free(blocks)
    hit, hashes = pool.match_prefix(prompt + [99])
    assert hit == blocks[:2] and len(hashes) == 2 and pool.hits == 8
    pool.free(hit)
    exact, _ = pool.match_prefix(list(range(8)))  # a prompt that is exactly two blocks: recompute the last
    assert exact == blocks[:1]
    pool.free(exact)
    other, _ = pool.match_prefix([0, 1, 2, 5, 4, 5, 6, 7, 8])
    assert other == []  # differs inside the first block


def test_prefix_chain_depends_on_everything_before():
    pool = BlockPool(8, 4, prefix_caching=True)
    pool.free(_fill(pool, [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    hit, _ = pool.match_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0])  # same second block, different first
    assert hit == []


def test_shared_blocks_are_counted_once_and_evicted_lru():
    pool = BlockPool(3, 4, prefix_caching=True)
    first = _fill(pool, [1, 1, 1, 1, 2])
    hit, _ = pool.match_prefix([1, 1, 1, 1, 3])  # running alongside: shares block 0
    assert hit == first[:1] and pool.num_used == 2
    pool.free(first)
    pool.free(hit)
    assert pool.num_used == 0
    pool.allocate(3)  # pressure: the cached block is reused for new content
    assert pool.match_prefix([1, 1, 1, 1, 3]) == ([], [])


def test_prefix_caching_off_matches_nothing():
    pool = BlockPool(4, 4)
    pool.free(_fill(pool, list(range(9))))
    assert pool.match_prefix(list(range(9))) == ([], [])


def test_block_names_are_a_salted_chain():
    pool = BlockPool(8, 4, prefix_caching=True)
    block = (5, 6, 7, 8)
    first = chain_hash(pool.salt, None, (1, 2, 3, 4))
    assert chain_hash(pool.salt, first, block) != chain_hash(
        pool.salt, chain_hash(pool.salt, None, (9, 9, 9, 9)), block
    )  # same tokens, different parents
    assert chain_hash(pool.salt, None, block) != chain_hash(pool.salt, first, block)
    assert len(first) == 16 and chain_hash(pool.salt, None, (1, 2, 3, 4)) == first  # deterministic in a pool
    other = BlockPool(8, 4, prefix_caching=True)
    assert other.salt != pool.salt and chain_hash(other.salt, None, (1, 2, 3, 4)) != first
    assert chain_hash(pool.salt, None, (1 << 40, 0, 0, 0)) != chain_hash(pool.salt, None, (0, 1 << 8, 0, 0))


def test_register_returns_the_chain_and_match_uses_it():
    pool = BlockPool(8, 4, prefix_caching=True)
    blocks = _fill(pool, list(range(9)))
    pool.free(blocks)
    hit, names = pool.match_prefix(list(range(9)))
    a = chain_hash(pool.salt, None, (0, 1, 2, 3))
    assert hit == blocks[:2] and names == [a, chain_hash(pool.salt, a, (4, 5, 6, 7))]


def _fill_scoped(pool: BlockPool, tokens: list[int], scope: str) -> list[int]:
    """_fill in namespace `scope`: the scheduler starts a prompt's chain at its scope's root."""
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    parent = pool.root(scope)
    for j in range(len(tokens) // pool.block_size):
        parent = pool.register(blocks[j], parent, tuple(tokens[j * 4 : (j + 1) * 4]))
    return blocks


def test_namespaces_never_share_blocks():
    """A prompt cached in one API key's namespace is no hit in another's (nor in the shared one), and is one in
    its own; the shared namespace ("") is the all-zero root, as before."""
    pool = BlockPool(16, 4, prefix_caching=True)
    prompt = list(range(9))
    pool.free(_fill_scoped(pool, prompt, "0"))
    assert pool.match_prefix(prompt, "1") == ([], [])
    assert pool.match_prefix(prompt) == ([], [])
    hit, _ = pool.match_prefix(prompt, "0")
    assert len(hit) == 2
    pool.free(hit)
    assert pool.root("") is None and pool.root("0") != pool.root("1")
    pool.free(_fill(pool, prompt))  # shared: root None
    shared, _ = pool.match_prefix(prompt)
    assert len(shared) == 2 and pool.match_prefix(prompt, "1") == ([], [])
