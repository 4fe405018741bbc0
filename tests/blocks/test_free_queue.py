"""The intrusive LRU free queue: exact order under append/remove/popleft; its integrity check."""

from __future__ import annotations

import pytest

from kvplane.blocks.free_queue import FreeBlockQueue
from kvplane.errors import BlockStateError, InvalidArgumentError
from kvplane.ids import BlockId


def test_starts_full_in_id_order() -> None:
    q = FreeBlockQueue(4)
    assert q.order() == [0, 1, 2, 3]
    assert len(q) == 4
    assert all(BlockId(b) in q for b in range(4))
    assert 4 not in q
    assert "x" not in q
    q.check_integrity()


def test_popleft_append_remove_exact_order() -> None:
    q = FreeBlockQueue(5)
    assert [q.popleft(), q.popleft()] == [0, 1]
    assert q.order() == [2, 3, 4]
    q.append(BlockId(1))
    q.append(BlockId(0))
    assert q.order() == [2, 3, 4, 1, 0]
    q.remove(BlockId(4))  # middle
    q.remove(BlockId(2))  # head
    q.remove(BlockId(0))  # tail
    assert q.order() == [3, 1]
    assert 4 not in q
    assert len(q) == 2
    q.check_integrity()
    q.extend([BlockId(0), BlockId(4), BlockId(2)])
    assert q.order() == [3, 1, 0, 4, 2]
    q.check_integrity()


def test_empty_queue_pops_none_and_refills() -> None:
    q = FreeBlockQueue(2)
    assert [q.popleft(), q.popleft(), q.popleft()] == [0, 1, None]
    assert len(q) == 0
    assert q.order() == []
    q.check_integrity()
    q.append(BlockId(1))
    assert q.order() == [1]
    assert q.popleft() == 1
    q.check_integrity()


def test_misuse_is_rejected_without_change() -> None:
    q = FreeBlockQueue(3)
    with pytest.raises(BlockStateError, match="block 1 is already"):
        q.append(BlockId(1))
    assert q.popleft() == 0
    with pytest.raises(BlockStateError, match="block 0 is not"):
        q.remove(BlockId(0))
    assert q.order() == [1, 2]
    q.check_integrity()
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="num_blocks"):
            FreeBlockQueue(bad)  # type: ignore[arg-type]


def test_integrity_check_detects_corruption() -> None:
    q = FreeBlockQueue(4)
    q._prev[2] = 0  # break the backward link of block 2
    with pytest.raises(BlockStateError, match=r"prev\[2\]"):
        q.check_integrity()
    q = FreeBlockQueue(4)
    q._len = 3
    with pytest.raises(BlockStateError, match="length 3"):
        q.check_integrity()
    q = FreeBlockQueue(4)
    q.remove(BlockId(1))
    q._linked[1] = True  # claims membership but is unreachable
    with pytest.raises(BlockStateError, match="block 1 marked linked"):
        q.check_integrity()
    q = FreeBlockQueue(3)
    q._next[1] = 0  # a cycle that never returns to the sentinel
    q._prev[0] = 1
    with pytest.raises(BlockStateError, match=r"next\[3\]=0 but prev\[0\]=1"):
        q.check_integrity()
