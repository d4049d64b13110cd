"""What the backend did: one record per compiled graph, summed into matches per family; and :func:`plural`, the
wording of a count in the messages of mindiesd and its tools."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Union

from .families import FAMILIES

__all__ = ["GraphRecord", "CompileReport", "MindieSDFallbackWarning", "fusion_report", "reset_fusion_report", "plural"]


class MindieSDFallbackWarning(UserWarning):
    """An internal failure made a graph (or a part of one) run unfused; the message names the cause."""


def plural(count: Union[int, str], word: str, many: Optional[str] = None) -> str:
    """``count`` and ``word`` as a message says them: "1 graph", "2 graphs", "1/4 graphs" (``count`` may be
    numbers joined by "/"; ``many``: the plural where it is not ``word + "s"``: "1 entry", "2 entries")."""
    return f"{count} {word if str(count) == '1' else many or word + 's'}"


@dataclass
class GraphRecord:
    """One graph handed to the backend by Dynamo."""

    graph_id: int
    nodes_before: int = 0
    nodes_after: int = 0
    matches: Dict[str, int] = field(default_factory=dict)
    rules: Dict[str, int] = field(default_factory=dict)  # rewrites per "family:rule"
    folded_constants: int = 0
    seconds: float = 0.0
    fallback: Optional[str] = None  # why the unfused graph runs, if it does
    skipped: Dict[str, str] = field(default_factory=dict)  # enabled families not fused on this device, and why
    cache: str = "off"  # persistent cache: "off", "hit", "stored", "store failed" or "not cached: <why>"
    kernel_choices: List[str] = field(default_factory=list)  # measured fused op sites: what runs, with the times

    def to_dict(self) -> dict:
        return asdict(self)


class CompileReport:
    """Records of the graphs a backend (or every backend) compiled so far."""

    def __init__(self) -> None:
        self._records: List[GraphRecord] = []
        self._lock = threading.Lock()

    def add(self, record: GraphRecord) -> None:
        with self._lock:
            self._records.append(record)

    @property
    def records(self) -> List[GraphRecord]:
        with self._lock:
            return list(self._records)

    @property
    def graphs(self) -> int:
        return len(self.records)

    @property
    def matches(self) -> Dict[str, int]:
        """Fused ops inserted per family, over all graphs (every family listed, zero included)."""
        total = {family: 0 for family in FAMILIES}
        for record in self.records:
            for family, count in record.matches.items():
                total[family] = total.get(family, 0) + count
        return total

    @property
    def rule_hits(self) -> Dict[str, int]:
        """Rewrites per ``"family:rule"`` over all graphs (rules that fired)."""
        total: Dict[str, int] = {}
        for record in self.records:
            for rule, count in record.rules.items():
                total[rule] = total.get(rule, 0) + count
        return total

    @property
    def compile_seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    @property
    def cache_hits(self) -> int:
        """Graphs loaded from the persistent cache instead of compiled."""
        return sum(1 for r in self.records if r.cache == "hit")

    @property
    def fallbacks(self) -> List[str]:
        return [r.fallback for r in self.records if r.fallback]

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def __repr__(self) -> str:
        return (f"CompileReport(graphs={self.graphs}, matches={self.matches}, "
                f"compile_seconds={self.compile_seconds:.2f}, fallbacks={len(self.fallbacks)})")


_GLOBAL = CompileReport()


def fusion_report() -> CompileReport:
    """The records of every MindieSD backend in this process."""
    return _GLOBAL


def reset_fusion_report() -> None:
    _GLOBAL.clear()
