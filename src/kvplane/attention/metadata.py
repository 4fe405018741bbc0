"""Paged-KV plan metadata: one object, CSR or dense block-table form, converted lazily.

:class:`PlanMetadata` is validated and converted at plan time; the caller must not mutate its
index tensors afterwards. Encodings and invariants: docs/attention.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.validators import require_int

_INDEX_DTYPES = (torch.int32, torch.int64)


class QueryClass(enum.Enum):
    """Shape of the per-request query lengths of a batch."""

    SINGLE = "single"  # every request has exactly one query token (decode)
    UNIFORM = "uniform"  # every request has the same number of query tokens (spec verify)
    VARLEN = "varlen"  # anything else (prefill, mixed decode/prefill batches)


def _index_vector(name: str, t: torch.Tensor, length: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES or t.dim() != 1:
        raise InvalidArgumentError(
            f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} of shape {tuple(t.shape)}"
        )
    if length is not None and t.shape[0] != length:
        raise InvalidArgumentError(f"{name} must have {length} entries, got {t.shape[0]}")


@dataclass(frozen=True, slots=True)
class CSRPageTable:
    """FlashInfer's form; see the module docstring. All tensors 1-D int32/int64, one device."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor

    def __post_init__(self) -> None:
        _index_vector("qo_indptr", self.qo_indptr)
        batch = self.qo_indptr.shape[0] - 1
        if batch < 1:
            raise InvalidArgumentError(f"qo_indptr needs >= 2 entries, got {batch + 1}")
        _index_vector("kv_indptr", self.kv_indptr, batch + 1)
        _index_vector("kv_indices", self.kv_indices)
        _index_vector("kv_len", self.kv_len, batch)

    @property
    def batch_size(self) -> int:
        return int(self.qo_indptr.shape[0]) - 1


@dataclass(frozen=True, slots=True)
class DensePageTable:
    """vLLM's form: ``block_table [B, max_pages]`` (int32/int64), ``kv_len [B]``, ``q_len [B]``."""

    block_table: torch.Tensor
    kv_len: torch.Tensor
    q_len: torch.Tensor

    def __post_init__(self) -> None:
        bt = self.block_table
        if not isinstance(bt, torch.Tensor) or bt.dtype not in _INDEX_DTYPES or bt.dim() != 2:
            raise InvalidArgumentError(
                f"block_table must be a 2-D int32/int64 tensor, got {getattr(bt, 'dtype', bt)!r}"
                f" of shape {tuple(getattr(bt, 'shape', ()))}"
            )
        if bt.shape[0] < 1:
            raise InvalidArgumentError("block_table needs at least one request row")
        _index_vector("kv_len", self.kv_len, int(bt.shape[0]))
        _index_vector("q_len", self.q_len, int(bt.shape[0]))

    @property
    def batch_size(self) -> int:
        return int(self.block_table.shape[0])


@dataclass(frozen=True, slots=True)
class PagedStructure:
    """Host-side structural facts of a validated batch (what a plan may depend on)."""

    page_size: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    max_page: int
    """Largest page id any request needs (``0`` when no request needs a page)."""

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)

    @property
    def pages_needed(self) -> tuple[int, ...]:
        return tuple(-(-n // self.page_size) for n in self.kv_lens)

    @property
    def query_class(self) -> QueryClass:
        first = self.q_lens[0]
        if all(n == first for n in self.q_lens):
            return QueryClass.SINGLE if first == 1 else QueryClass.UNIFORM
        return QueryClass.VARLEN


def _check_indptr(name: str, indptr: torch.Tensor) -> None:
    if int(indptr[0]) != 0 or bool((indptr[1:] < indptr[:-1]).any()):
        raise InvalidArgumentError(
            f"{name} must start at 0 and never decrease, got {indptr.tolist()}"
        )


class PlanMetadata:
    """The page table of one batch, in CSR and/or dense form; see the module docstring."""

    def __init__(
        self,
        page_size: int,
        *,
        csr: CSRPageTable | None = None,
        dense: DensePageTable | None = None,
    ) -> None:
        require_int("page_size", page_size, min=1)
        if csr is None and dense is None:
            raise InvalidArgumentError("PlanMetadata needs a CSR form, a dense form or both")
        if csr is not None and dense is not None and csr.batch_size != dense.batch_size:
            raise InvalidArgumentError(
                f"CSR form has {csr.batch_size} requests but dense form has {dense.batch_size}"
            )
        self.page_size = page_size
        self._csr = csr
        self._dense = dense
        self._structure: PagedStructure | None = None
        self._given = tuple(n for n, f in (("csr", csr), ("dense", dense)) if f is not None)

    @classmethod
    def from_csr(
        cls,
        page_size: int,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len: torch.Tensor,
    ) -> PlanMetadata:
        return cls(page_size, csr=CSRPageTable(qo_indptr, kv_indptr, kv_indices, kv_len))

    @classmethod
    def from_dense(
        cls, page_size: int, block_table: torch.Tensor, kv_len: torch.Tensor, q_len: torch.Tensor
    ) -> PlanMetadata:
        return cls(page_size, dense=DensePageTable(block_table, kv_len, q_len))

    @property
    def batch_size(self) -> int:
        form = self._csr if self._csr is not None else self._dense
        assert form is not None  # guaranteed by __init__
        return form.batch_size

    @property
    def given_forms(self) -> tuple[str, ...]:
        """Which forms the caller supplied (``"csr"``, ``"dense"``), for diagnostics."""
        return self._given

    # -- validation ----------------------------------------------------------------------------
    def structure(self) -> PagedStructure:
        """Validate (once) and return the host-side facts; raises ``InvalidArgumentError``."""
        if self._structure is None:
            got = [self._validate_csr(self._csr)] if self._csr is not None else []
            if self._dense is not None:
                got.append(self._validate_dense(self._dense))
            if len(got) == 2:
                self._check_equivalent(got[0], got[1])
            q_lens, kv_lens, needed = got[0]
            max_page = int(needed.max()) if needed.numel() else 0
            self._structure = PagedStructure(self.page_size, q_lens, kv_lens, max_page)
        return self._structure

    def _needed_count(self, kv_len: torch.Tensor) -> torch.Tensor:
        """``ceil(kv_len / page_size)`` for ``kv_len >= 0``, exact up to the dtype's maximum
        (no ``kv_len + page_size - 1`` intermediate that could overflow)."""
        return kv_len // self.page_size + (kv_len % self.page_size != 0).to(kv_len.dtype)

    def _validate_csr(
        self, csr: CSRPageTable
    ) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
        qo, kvp = csr.qo_indptr.cpu().long(), csr.kv_indptr.cpu().long()
        kv_len, indices = csr.kv_len.cpu().long(), csr.kv_indices.cpu().long()
        _check_indptr("qo_indptr", qo)
        _check_indptr("kv_indptr", kvp)
        if int(kvp[-1]) > indices.shape[0]:
            raise InvalidArgumentError(
                f"kv_indptr[-1]={int(kvp[-1])} exceeds len(kv_indices)={indices.shape[0]}"
            )
        self._check_kv_len(kv_len)
        have, need = kvp[1:] - kvp[:-1], self._needed_count(kv_len)
        short = (have < need).nonzero().flatten()
        if short.numel():
            b = int(short[0])
            raise InvalidArgumentError(
                f"request {b} has kv_len {int(kv_len[b])} needing {int(need[b])} pages of "
                f"{self.page_size} but kv_indptr gives it {int(have[b])}"
            )
        starts = torch.repeat_interleave(kvp[:-1], need)
        offsets = torch.arange(int(need.sum())) - torch.repeat_interleave(
            need.cumsum(0) - need, need
        )
        needed = indices[starts + offsets]
        self._check_pages(needed)
        return tuple((qo[1:] - qo[:-1]).tolist()), tuple(kv_len.tolist()), needed

    def _validate_dense(
        self, dense: DensePageTable
    ) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
        bt, kv_len = dense.block_table.cpu().long(), dense.kv_len.cpu().long()
        q_len = dense.q_len.cpu().long()
        if bool((q_len < 0).any()):
            raise InvalidArgumentError(f"q_len must be >= 0, got {q_len.tolist()}")
        self._check_kv_len(kv_len)
        need = self._needed_count(kv_len)
        if bool((need > bt.shape[1]).any()):
            b = int((need > bt.shape[1]).nonzero()[0])
            raise InvalidArgumentError(
                f"request {b} has kv_len {int(kv_len[b])} needing {int(need[b])} pages but the "
                f"block table has {bt.shape[1]} columns"
            )
        mask = torch.arange(bt.shape[1])[None, :] < need[:, None]
        needed = bt[mask]
        self._check_pages(needed)
        return tuple(q_len.tolist()), tuple(kv_len.tolist()), needed

    @staticmethod
    def _check_kv_len(kv_len: torch.Tensor) -> None:
        if bool((kv_len < 0).any()):
            raise InvalidArgumentError(f"kv_len must be >= 0, got {kv_len.tolist()}")

    @staticmethod
    def _check_pages(needed: torch.Tensor) -> None:
        if needed.numel() and int(needed.min()) < 0:
            raise InvalidArgumentError(f"page ids must be >= 0, got {int(needed.min())}")

    @staticmethod
    def _check_equivalent(
        a: tuple[tuple[int, ...], tuple[int, ...], torch.Tensor],
        b: tuple[tuple[int, ...], tuple[int, ...], torch.Tensor],
    ) -> None:
        for what, x, y in (("q lengths", a[0], b[0]), ("kv lengths", a[1], b[1])):
            if x != y:
                raise InvalidArgumentError(f"CSR and dense forms disagree on {what}: {x} vs {y}")
        if not torch.equal(a[2], b[2]):
            raise InvalidArgumentError("CSR and dense forms name different pages for the batch")

    # -- conversions ---------------------------------------------------------------------------
    def csr(self) -> CSRPageTable:
        """The CSR form (given, or built from the dense form: int32, only needed pages)."""
        if self._csr is None:
            assert self._dense is not None
            self.structure()
            d = self._dense
            need = self._needed_count(d.kv_len.long())
            mask = torch.arange(d.block_table.shape[1], device=need.device)[None, :] < need[:, None]
            zero = torch.zeros(1, dtype=torch.int32, device=need.device)
            self._csr = CSRPageTable(
                qo_indptr=torch.cat([zero, d.q_len.cumsum(0).int()]),
                kv_indptr=torch.cat([zero, need.cumsum(0).int()]),
                kv_indices=d.block_table[mask].int(),
                kv_len=d.kv_len.int(),
            )
        return self._csr

    def dense(self) -> DensePageTable:
        """The dense form (given, or built from CSR: int32, padding entries are page 0)."""
        if self._dense is None:
            assert self._csr is not None
            s = self.structure()
            c = self._csr
            dev = c.kv_indices.device
            need = torch.tensor(s.pages_needed, dtype=torch.long, device=dev)
            width = max(s.pages_needed)
            mask = torch.arange(width, device=dev)[None, :] < need[:, None]
            table = torch.zeros((s.batch_size, width), dtype=torch.int32, device=dev)
            starts = torch.repeat_interleave(c.kv_indptr[:-1].long(), need)
            offsets = torch.arange(int(need.sum()), device=dev) - torch.repeat_interleave(
                need.cumsum(0) - need, need
            )
            table[mask] = c.kv_indices.long()[starts + offsets].int()
            q = c.qo_indptr.long()
            self._dense = DensePageTable(table, c.kv_len.int(), (q[1:] - q[:-1]).int())
        return self._dense
