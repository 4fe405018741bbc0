"""Chunk keys of a request: deterministic, incremental, rooted in the engine fingerprint."""

from __future__ import annotations

import pytest

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.keys import LoraIdentity, RequestKeys, request_extra_keys

SPEC = ChunkSpec(block_size=4, blocks_per_chunk=2)
HASHER = BlockHasher(seed=3, fingerprint=b"engine-a")
TOKENS = list(range(100, 130))  # 30 tokens: 7 full blocks, 3 full chunks


def test_keys_are_the_chained_hashes_of_each_chunks_last_block() -> None:
    keys = RequestKeys(HASHER, SPEC)
    keys.extend(TOKENS)
    hashes = HASHER.hash_blocks(TOKENS, 4)
    assert keys.num_hashed_blocks == 7
    assert keys.chunk_keys(30) == [hashes[1], hashes[3], hashes[5]]
    assert keys.chunk_keys(16) == [hashes[1], hashes[3]]
    assert keys.chunk_keys(7) == []


def test_incremental_extension_equals_one_shot() -> None:
    step = RequestKeys(HASHER, SPEC)
    for n in (3, 8, 9, 17, 30):
        step.extend(TOKENS, n)
    whole = RequestKeys(HASHER, SPEC)
    whole.extend(TOKENS)
    assert step.chunk_keys(30) == whole.chunk_keys(30)


def test_keys_change_with_fingerprint_seed_extra_keys_and_any_earlier_token() -> None:
    def keys_of(hasher: BlockHasher, tokens: list[int], extra: tuple[str, ...] = ()) -> list[bytes]:
        k = RequestKeys(hasher, SPEC, extra)
        k.extend(tokens)
        return list(k.chunk_keys(len(tokens)))

    base = keys_of(HASHER, TOKENS)
    other_engine = keys_of(BlockHasher(3, b"engine-b"), TOKENS)
    other_seed = keys_of(BlockHasher(4, b"engine-a"), TOKENS)
    salted = keys_of(HASHER, TOKENS, request_extra_keys(None, "tenant-1"))
    changed = keys_of(HASHER, [7, *TOKENS[1:]])
    for other in (other_engine, other_seed, salted, changed):
        assert set(other).isdisjoint(base)
    later = keys_of(HASHER, [*TOKENS[:20], 5, *TOKENS[21:]])  # token 20 is in chunk 2
    assert later[:2] == base[:2] and later[2] != base[2]


def test_extra_keys_are_tagged() -> None:
    assert request_extra_keys(None, None) == ()
    lora = LoraIdentity("adapter", 3, "stamp")
    assert request_extra_keys(lora, "s") == ("lora", "adapter", 3, "stamp", "salt", "s")


def test_adapters_differing_in_id_or_files_derive_different_keys() -> None:
    def keys_of(lora: LoraIdentity) -> set[bytes]:
        k = RequestKeys(HASHER, SPEC, request_extra_keys(lora, None))
        k.extend(TOKENS)
        return set(k.chunk_keys(len(TOKENS)))

    base = keys_of(LoraIdentity("sql", 1, "a"))
    for other in (LoraIdentity("sql", 2, "a"), LoraIdentity("sql", 1, "b")):
        assert keys_of(other).isdisjoint(base)
    with pytest.raises(InvalidArgumentError, match="int_id"):
        LoraIdentity("sql", True, "a")


def test_bad_calls_raise_before_changing_anything() -> None:
    keys = RequestKeys(HASHER, SPEC)
    with pytest.raises(InvalidArgumentError, match="31"):
        keys.extend(TOKENS, 31)
    with pytest.raises(InvalidArgumentError, match="extend"):
        keys.chunk_keys(8)
    assert keys.num_hashed_blocks == 0


def test_refusals_are_worded_exactly() -> None:
    keys = RequestKeys(HASHER, SPEC)
    for bad in (31, -1, True, 3.0):
        with pytest.raises(InvalidArgumentError) as err:
            keys.extend(TOKENS, bad)  # type: ignore[arg-type]
        assert str(err.value) == (
            f"num_tokens (at most the known tokens) must be an int in [0, 30], got {bad!r}"
        )
    with pytest.raises(InvalidArgumentError) as err:
        LoraIdentity("sql", True, "a")
    assert str(err.value) == "LoraIdentity.int_id must be an int, got True"
    keys.extend(TOKENS, 0)
    assert keys.num_hashed_blocks == 0
