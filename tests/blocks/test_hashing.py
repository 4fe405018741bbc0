"""Block hashing: canonical bytes, chaining, sensitivity, golden digests, process stability."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvplane.blocks.hashing import (
    DIGEST_SIZE,
    BlockHasher,
    canonical_token_ids,
    encode_extra_keys,
)
from kvplane.config import HashConfig
from kvplane.errors import InvalidArgumentError
from kvplane.ids import BlockHash

GOLDEN_FP = b"kvplane-golden"
GOLDEN_KEYS = ("lora-a", 7, b"\x00")
# Computed once with seed=0, fingerprint=GOLDEN_FP, tokens 0..9, block_size 4, GOLDEN_KEYS.
# A change here means every stored hash, chunk key and handshake changes: bump the domain tags.
GOLDEN_ROOT = "a198827d6dbcd4b9f91cf1592c874edf8bdee1e54afad50619bf4b7f4af61ef1"
GOLDEN_BLOCKS = [
    "b23bb32841f8c744fb9b77f9cd319cfdbe11cf980ac218c1574fe48684be97a0",
    "5d6dbc1f7a406bb372d62e9c7cf8a22532a46f2768728526970348e4f04f0365",
]

_SCRIPT = """
from kvplane.blocks.hashing import BlockHasher
h = BlockHasher(seed=0, fingerprint=b"kvplane-golden")
print(h.root.hex())
for d in h.hash_blocks(list(range(10)), 4, ("lora-a", 7, b"\\x00")):
    print(d.hex())
"""


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _spec_block(parent: bytes, tokens: list[int], extra: bytes) -> bytes:
    """The documented canonical form, re-derived independently of the implementation."""
    body = np.asarray(tokens, dtype="<i8").tobytes()
    msg = b"kvplane/block-hash/block/v1" + parent + _u64(len(tokens)) + body + extra
    return hashlib.blake2b(msg, digest_size=32).digest()


def test_golden_digests_match_the_documented_canonical_form() -> None:
    h = BlockHasher(seed=0, fingerprint=GOLDEN_FP)
    root = hashlib.blake2b(
        b"kvplane/block-hash/root/v1" + _u64(1) + b"\x00" + _u64(len(GOLDEN_FP)) + GOLDEN_FP,
        digest_size=32,
    ).digest()
    extra = (
        _u64(3)
        + b"s" + _u64(6) + b"lora-a"
        + b"i" + _u64(1) + b"\x07"
        + b"b" + _u64(1) + b"\x00"
    )  # fmt: skip
    assert encode_extra_keys(GOLDEN_KEYS) == extra
    b0 = _spec_block(root, [0, 1, 2, 3], extra)
    b1 = _spec_block(b0, [4, 5, 6, 7], extra)
    assert h.root == root
    assert h.root.hex() == GOLDEN_ROOT
    assert [d.hex() for d in h.hash_blocks(list(range(10)), 4, GOLDEN_KEYS)] == GOLDEN_BLOCKS
    assert [b0.hex(), b1.hex()] == GOLDEN_BLOCKS


def test_identical_across_processes_whatever_pythonhashseed() -> None:
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.split())
    assert outputs[0] == outputs[1] == [GOLDEN_ROOT, *GOLDEN_BLOCKS]


def test_chaining_and_partial_tail() -> None:
    h = BlockHasher(seed=3, fingerprint=b"fp")
    hashes = h.hash_blocks(list(range(11)), 4)
    assert len(hashes) == 2  # tokens 8..10 are a partial tail: not hashed
    assert hashes[0] == h.hash_block(None, [0, 1, 2, 3])
    assert hashes[0] == h.hash_block(h.root, [0, 1, 2, 3])
    assert hashes[1] == h.hash_block(hashes[0], [4, 5, 6, 7])
    # continuing a chain from a parent gives the same hashes as hashing in one go
    assert h.hash_blocks([4, 5, 6, 7], 4, parent=hashes[0]) == [hashes[1]]
    assert h.hash_blocks([1, 2, 3], 4) == []
    assert h.hash_blocks([], 4) == []
    # the same block content after a different prefix hashes differently
    other = h.hash_blocks([9, 9, 9, 9, 4, 5, 6, 7], 4)
    assert other[1] != hashes[1]
    assert all(len(d) == DIGEST_SIZE for d in hashes)


def test_input_forms_hash_alike() -> None:
    h = BlockHasher(seed=1, fingerprint=b"fp")
    ref = h.hash_blocks([5, 6, 7, 2**62], 2)
    assert h.hash_blocks((5, 6, 7, 2**62), 2) == ref
    assert h.hash_blocks(np.array([5, 6, 7, 2**62], dtype=np.uint64), 2) == ref
    assert h.hash_blocks(np.array([5, 6, 7, 2**62], dtype=">i8"), 2) == ref
    assert h.hash_blocks(torch.tensor([5, 6, 7, 2**62]), 2) == ref
    assert h.hash_blocks(np.array([5, 6, 7, 9], dtype=np.int32), 2)[0] == ref[0]
    assert h.hash_blocks(torch.tensor([5, 6], dtype=torch.int32), 2) == ref[:1]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (BlockHasher(0, b"fp"), BlockHasher(1, b"fp")),
        (BlockHasher(0, b"fp"), BlockHasher(0, b"fq")),
        (BlockHasher(0, b""), BlockHasher(0, b"\x00")),
        (BlockHasher(2**64, b"fp"), BlockHasher(0, b"fp")),
    ],
)
def test_seed_and_fingerprint_change_the_hash(a: BlockHasher, b: BlockHasher) -> None:
    assert a.root != b.root
    assert a.hash_blocks([1, 2], 2) != b.hash_blocks([1, 2], 2)


def test_extra_keys_change_the_hash_without_aliasing() -> None:
    h = BlockHasher(seed=0, fingerprint=b"fp")
    variants = [
        (),
        ("a",),
        (b"a",),
        (97,),
        ("ab",),
        ("a", "b"),
        ("a", ""),
        ("",),
        (0,),
        (-1,),
        (255,),
        (2**80,),
        ("lora", "salt"),
        ("salt", "lora"),
    ]
    digests = {h.hash_block(None, [1, 2, 3], keys) for keys in variants}
    assert len(digests) == len(variants)
    assert h.hash_block(None, [1, 2, 3], ["a", 1]) == h.hash_block(None, [1, 2, 3], ("a", 1))


def test_token_boundaries_do_not_alias() -> None:
    h = BlockHasher(seed=0, fingerprint=b"fp")
    assert h.hash_block(None, [1, 2]) != h.hash_block(None, [1, 2, 0])
    assert h.hash_block(None, [256]) != h.hash_block(None, [0, 1])


def test_from_config() -> None:
    assert BlockHasher.from_config(HashConfig(seed=7), b"x") == BlockHasher(7, b"x")
    assert BlockHasher.from_config(HashConfig(seed=7), b"x").root == BlockHasher(7, b"x").root


def test_canonical_token_ids_is_a_fresh_int64_copy() -> None:
    src = np.array([3, 4], dtype=np.int64)
    out = canonical_token_ids(src)
    out[0] = 99
    assert src.tolist() == [3, 4]
    assert canonical_token_ids([]).dtype == np.dtype("<i8")
    assert canonical_token_ids([]).shape == (0,)


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, -2], "-2"),
        ([1, 2**63], str(2**63)),
        ([1, 2**64 + 5], str(2**64 + 5)),
        ([1, -(2**70)], str(-(2**70))),
        ([7, True], "True"),
        ([1.5, 2.0], "1.5"),
        ([1, 2.0], "2.0"),
        ([True, False], "True"),
        (["a"], "'a'"),
        ("abc", "'abc'"),
        (b"abc", "b'abc'"),
        ([[1, 2], [3, 4]], r"\(2, 2\)"),
        ([[1], [2, 3]], "flat"),
        ([1, None], "None"),
        (np.array([1.0]), "float64"),
        (np.array([-1], dtype=np.int8), "-1"),
        (np.array([2**63], dtype=np.uint64), str(2**63)),
        (torch.tensor([1.0]), "float32"),
        (torch.tensor([True]), "bool"),
        (torch.tensor([-3]), "-3"),
        (torch.zeros(2, 2, dtype=torch.int64), r"\(2, 2\)"),
    ],
)
def test_bad_token_ids_are_rejected(tokens: object, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        canonical_token_ids(tokens)  # type: ignore[arg-type]


def test_bad_hasher_arguments_are_rejected() -> None:
    h = BlockHasher(seed=0, fingerprint=b"fp")
    with pytest.raises(InvalidArgumentError, match="-1"):
        BlockHasher(seed=-1, fingerprint=b"fp")
    with pytest.raises(InvalidArgumentError, match="True"):
        BlockHasher(seed=True, fingerprint=b"fp")
    with pytest.raises(InvalidArgumentError, match="'fp'"):
        BlockHasher(seed=0, fingerprint="fp")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        h.hash_block(None, [])
    with pytest.raises(InvalidArgumentError, match="parent"):
        h.hash_block(BlockHash(b"short"), [1])
    with pytest.raises(InvalidArgumentError, match="parent"):
        h.hash_blocks([1, 2], 2, parent="x" * 32)  # type: ignore[arg-type]
    for bad_size in (0, -4, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="block_size"):
            h.hash_blocks([1, 2], bad_size)  # type: ignore[arg-type]
    for bad_key, match in ((1.5, "float"), (True, "bool"), (None, "NoneType"), (("t",), "tuple")):
        with pytest.raises(InvalidArgumentError, match=match):
            h.hash_block(None, [1], (bad_key,))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="extra_keys"):
        h.hash_block(None, [1], "lora")  # type: ignore[arg-type]


def test_hasher_is_a_frozen_value() -> None:
    h = BlockHasher(seed=0, fingerprint=b"fp")
    with pytest.raises(AttributeError):
        h.seed = 1  # type: ignore[misc]
    assert h == BlockHasher(seed=0, fingerprint=b"fp")
    assert hash(h) == hash(BlockHasher(seed=0, fingerprint=b"fp"))


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated; still a caller's input
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 1.0, 0, torch.quint8)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: [7, True], "got True"),  # numpy alone would make this int64 [7, 1]
        (lambda: [True, 7], "got True"),
        (lambda: [7, np.True_], "True"),
        (lambda: 5, "sequence of ints, got 5"),
        (lambda: None, "sequence of ints, got None"),
        (lambda: torch.tensor([1, 2]).to_sparse(), "dense integer tensor"),
        (_quantized, "dense integer tensor"),
    ],
    ids=["bool-last", "bool-first", "numpy-bool", "scalar", "none", "sparse", "quantized"],
)
def test_bools_among_ints_and_non_iterables_are_typed_errors(
    make: Callable[[], object], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        canonical_token_ids(make())  # type: ignore[arg-type]


def test_a_bool_never_hashes_like_one() -> None:
    h = BlockHasher(seed=0, fingerprint=b"fp")
    with pytest.raises(InvalidArgumentError, match="True"):
        h.hash_blocks([7, True], 2)
    assert canonical_token_ids([7, np.int64(1)]).tolist() == [7, 1]  # numpy ints stay fine
