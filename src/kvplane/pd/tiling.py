"""Receiver-side coverage of a multi-sender session: the pieces received must tile the
destination (heads × layers × tokens) exactly once before the receiver may commit.

:class:`Tiling` owns the accepted pieces of one destination :class:`~kvplane.transfer.resharding.
KVBox`; a piece outside it, a duplicate or an overlap is a ``ProtocolError`` raised before
anything changes (never a silent overwrite), and :meth:`Tiling.check_complete` refuses an
incomplete union. Sans-IO and tensor-free: it counts cells and never touches memory.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from kvplane.errors import ProtocolError
from kvplane.ids import TokenRange
from kvplane.transfer.resharding import KVBox, Piece, SenderId

_Key = tuple[tuple[int, int], tuple[int, ...]]
"""A piece's heads and layers: pieces of one key differ only in their tokens."""


@dataclass(slots=True)
class _Runs:
    """The token ranges received for one key, sorted by start (disjoint), with their senders."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    senders: list[SenderId] = field(default_factory=list)

    def clash(self, tokens: TokenRange) -> int | None:
        """Index of a received range that shares a token with the non-empty ``tokens``."""
        i = bisect_right(self.starts, tokens.start) - 1
        if i >= 0 and self.ends[i] > tokens.start:
            return i
        if i + 1 < len(self.starts) and self.starts[i + 1] < tokens.end:
            return i + 1
        return None

    def insert(self, tokens: TokenRange, sender: SenderId) -> None:
        i = bisect_right(self.starts, tokens.start)
        self.starts.insert(i, tokens.start)
        self.ends.insert(i, tokens.end)
        self.senders.insert(i, sender)


class Tiling:
    """The pieces accepted so far for ``destination``. Cost per :meth:`add`: one binary search
    per distinct (heads, layers) key it shares cells with (a few: one per sender group), so
    a session of many slices stays cheap."""

    def __init__(self, destination: KVBox) -> None:
        if not isinstance(destination, KVBox):
            raise ProtocolError(f"a tiling needs a KVBox destination, got {destination!r}")
        self.destination = destination
        self.received_cells = 0
        self.pieces = 0
        self._runs: dict[_Key, _Runs] = {}
        self._layer_sets: dict[_Key, frozenset[int]] = {}

    @property
    def complete(self) -> bool:
        """True when the accepted pieces cover every destination cell (exactly once: overlaps
        were refused, so equal cell counts mean equal sets)."""
        return self.received_cells == self.destination.cells

    @property
    def senders(self) -> frozenset[SenderId]:
        """Every sender a piece was accepted from."""
        return frozenset(s for runs in self._runs.values() for s in runs.senders)

    def conflict(self, piece: object) -> str | None:
        """Why ``piece`` cannot be added (outside the destination, a duplicate, an overlap), or
        None. A piece with no tokens holds no cell and never conflicts."""
        if not isinstance(piece, Piece):
            return f"a tiling takes Pieces, got {piece!r}"
        box = piece.box
        if box.tokens.empty:
            return None
        if not self.destination.contains(box):
            return f"piece {piece} is outside the destination {self.destination}"
        layers = frozenset(box.layers)
        for (heads, key_layers), runs in self._runs.items():
            if heads[0] >= box.heads[1] or box.heads[0] >= heads[1]:
                continue
            if layers.isdisjoint(self._layer_sets[(heads, key_layers)]):
                continue
            i = runs.clash(box.tokens)
            if i is None:
                continue
            other = KVBox(heads, key_layers, TokenRange(runs.starts[i], runs.ends[i]))
            what = "duplicates" if other == box else "overlaps"
            return f"piece {piece} {what} {other} from {runs.senders[i]}"
        return None

    def add(self, piece: Piece) -> None:
        """Accept ``piece``; ``ProtocolError`` (see :meth:`conflict`) before any change."""
        why = self.conflict(piece)
        if why is not None:
            raise ProtocolError(why)
        box = piece.box
        if box.tokens.empty:
            return
        key = (box.heads, box.layers)
        runs = self._runs.get(key)
        if runs is None:
            runs = self._runs[key] = _Runs()
            self._layer_sets[key] = frozenset(box.layers)
        runs.insert(box.tokens, piece.sender)
        self.received_cells += box.cells
        self.pieces += 1

    def check_complete(self) -> None:
        """Return when the destination is tiled; ``ProtocolError`` naming how many cells are
        missing otherwise (an incomplete union is never committable)."""
        if not self.complete:
            want = self.destination.cells
            raise ProtocolError(
                f"destination {self.destination} is incomplete: {self.received_cells} of "
                f"{want} cells received from {self.pieces} piece(s)"
            )
