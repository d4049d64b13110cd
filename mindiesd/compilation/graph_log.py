"""The graph log: each pass's graph before and after, per compiled graph, as readable text (``graph_log_url``).

Layout under the folder::

    graph_000/00_aten.txt              the aten graph from aot, before freezing
    graph_000/01_freezing.txt          the main graph after freezing (folded weights become inputs)
    graph_000/02_rms_norm.before.txt   ... one before/after pair per pass that ran
    graph_000/summary.json             matches per family, node counts, seconds, fallback if any
    summary.txt                        one line per compiled graph, appended
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, Optional
from urllib.parse import unquote, urlparse

from torch.fx import GraphModule

__all__ = ["GraphLog", "resolve_log_dir"]

_lock = threading.Lock()


def resolve_log_dir(url: Optional[str]) -> Optional[str]:
    """A folder path from a plain path or a ``file://`` URL; other schemes are rejected."""
    if url is None:
        return None
    parsed = urlparse(url)
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
        path = unquote(parsed.path) if parsed.scheme == "file" else url
        return os.path.abspath(os.path.expanduser(path))
    raise ValueError(f"graph_log_url must be a folder path or a file:// URL, got {url!r}")


def graph_text(gm: GraphModule) -> str:
    """The graph as Python code, with each node's shape and dtype."""
    try:
        return gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    except TypeError:  # older torch without these keywords
        return gm.print_readable(print_output=False)


class GraphLog:
    """Writes the files of one compiled graph; a no-op when no folder is configured."""

    def __init__(self, folder: Optional[str], graph_id: int):
        self.folder = None
        self.step = 0
        if folder is not None:
            self.root = folder
            self.folder = os.path.join(folder, f"graph_{graph_id:03d}")
            os.makedirs(self.folder, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def graph(self, label: str, gm: GraphModule) -> None:
        if self.folder is None:
            return
        path = os.path.join(self.folder, f"{self.step:02d}_{label}.txt")
        self.step += 1
        with open(path, "w", encoding="utf-8") as f:
            f.write(graph_text(gm))

    def pass_pair(self, name: str, before: str, after: GraphModule) -> None:
        if self.folder is None:
            return
        stem = os.path.join(self.folder, f"{self.step:02d}_{name}")
        self.step += 1
        with open(stem + ".before.txt", "w", encoding="utf-8") as f:
            f.write(before)
        with open(stem + ".after.txt", "w", encoding="utf-8") as f:
            f.write(graph_text(after))

    def summary(self, record: Dict[str, Any], line: str) -> None:
        if self.folder is None:
            return
        with open(os.path.join(self.folder, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2, sort_keys=True)
        with _lock, open(os.path.join(self.root, "summary.txt"), "a", encoding="utf-8") as f:
            f.write(line + "\n")
