"""Workload buckets and the cache of measured backend rankings (in memory, optionally on disk).

An unreadable file, or one of another :data:`FORMAT` version, is ignored, never trusted. See
docs/attention.md.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvplane.attention.metadata import QueryClass
from kvplane.attention.problem import AttentionProblem, GQAShape, QueryLayout

FORMAT = "kvplane.attention.rankings/2"
"""The file format; bumped whenever :meth:`WorkloadBucket.key` changes (``/2``: the query
layout joined the key), so a file of older keys is ignored and replaced, not kept forever."""


def pow2_bucket(n: int) -> int:
    """Smallest power of two >= ``n`` (``1`` for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True, slots=True)
class WorkloadBucket:
    kind: str
    batch: int
    query_class: str
    q_len: int | None  # the common query length; None for the varlen class
    kv_bucket: int
    heads: int
    dims: tuple[int, ...]
    page_size: int
    dtype: str
    device: str
    causal: bool
    layout: str = QueryLayout.PACKED.value

    @classmethod
    def of(cls, problem: AttentionProblem) -> WorkloadBucket:
        s = problem.metadata.structure()
        sh = problem.shape
        if isinstance(sh, GQAShape):
            dims: tuple[int, ...] = (sh.num_kv_heads, sh.head_dim)
        else:
            dims = (sh.kv_lora_rank, sh.rope_dim, sh.qk_nope_dim or 0, sh.v_head_dim or 0)
        qc = s.query_class
        return cls(
            kind=problem.kind.value,
            batch=s.batch_size,
            query_class=qc.value,
            q_len=None if qc is QueryClass.VARLEN else s.max_q_len,
            kv_bucket=pow2_bucket(s.max_kv_len),
            heads=problem.num_heads,
            dims=dims,
            page_size=s.page_size,
            dtype=str(problem.dtype).removeprefix("torch."),
            device=problem.device.type,
            causal=problem.causal,
            layout=problem.query_layout.value,
        )

    def key(self) -> str:
        """A stable string form (the on-disk key)."""
        dims = "x".join(map(str, self.dims))
        q = "" if self.q_len is None else str(self.q_len)
        return (
            f"{self.kind}|b{self.batch}|{self.query_class}{q}|kv{self.kv_bucket}|"
            f"h{self.heads}|d{dims}|ps{self.page_size}|{self.dtype}|{self.device}|"
            f"{'causal' if self.causal else 'full'}|{self.layout}"
        )


@dataclass(frozen=True, slots=True)
class RankedCandidate:
    name: str
    seconds: float


Ranking = tuple[RankedCandidate, ...]


class RankingCache:
    """Bucket -> ranking (fastest first); see the module docstring."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._rankings: dict[str, Ranking] = {}
        if self.path is not None:
            self._rankings.update(self._load(self.path))

    @staticmethod
    def _load(path: Path) -> dict[str, Ranking]:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            return {}
        out: dict[str, Ranking] = {}
        entries = raw.get("rankings", {})
        if not isinstance(entries, dict):
            return {}
        for key, items in entries.items():
            try:
                out[str(key)] = tuple(RankedCandidate(str(name), float(sec)) for name, sec in items)
            except (TypeError, ValueError):
                continue
        return out

    def get(self, bucket: WorkloadBucket) -> Ranking | None:
        return self._rankings.get(bucket.key())

    def put(self, bucket: WorkloadBucket, ranking: Ranking) -> None:
        self._rankings[bucket.key()] = ranking
        if self.path is not None:
            self._save(self.path)

    def _save(self, path: Path) -> None:
        doc = {
            "format": FORMAT,
            "rankings": {
                k: [[c.name, c.seconds] for c in v] for k, v in sorted(self._rankings.items())
            },
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def __len__(self) -> int:
        return len(self._rankings)
