"""The cache's size limit (``cache_max_bytes``; docs/cache.md, "A bounded cache").

What a user checks: however many graphs and resolutions are stored, the folder stays under the limit; what was
used last survives (a load counts as a use); processes sharing the folder keep it under the limit together; an
entry larger than the limit is compiled and kept in memory; ``python -m mindiesd cache`` shows the limit.
"""

from __future__ import annotations

import multiprocessing
import stat
import warnings

import pytest
import torch

from fusion_utils import AddsTable, WeightedBlock, assert_close
from mindiesd.compilation import CompilationConfig, MindieSDBackend, MindieSDCacheWarning, aot_compile
from mindiesd.compilation.storage import cache as graph_cache
from mindiesd.compilation.storage.cache import CacheFolder, GraphCache


def _entry(size: int) -> graph_cache.CachedGraph:
    """An entry of about ``4 * size`` bytes (the graph reads a table of ``size`` floats, stored with it)."""
    return graph_cache.CachedGraph(main=torch.fx.symbolic_trace(AddsTable(size)), nodes_after=size)


def _key(i: int, prefix: str = "") -> str:
    return f"{prefix}{i:x}".rjust(64, "0")[::-1]  # distinct leading characters: several entry folders


def _total(root) -> int:
    return graph_cache.describe(str(root))[2]


def test_a_soak_of_stores_stays_under_the_limit_and_keeps_the_most_recently_used(tmp_path):
    entry = _entry(20_000)
    size = len(graph_cache._encode(entry, _key(0)))
    limit = int(4.5 * size)
    cache = GraphCache(CacheFolder(tmp_path, max_bytes=limit))
    favourite = _key(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDCacheWarning)
        cache.store(favourite, entry)
        for i in range(1, 31):
            assert cache.store(_key(i), entry) is not None
            assert _total(tmp_path) <= limit
            assert cache.load(favourite) is not None, f"the entry used last was evicted at store {i}"
    kept = {path.stem for path in graph_cache.cache_entries(str(tmp_path))}
    assert favourite in kept and _key(30) in kept and _key(29) in kept
    assert _key(1) not in kept and len(kept) == 4


def test_processes_sharing_a_folder_keep_it_under_the_limit_together(tmp_path):
    size = len(graph_cache._encode(_entry(25_000), _key(0)))
    limit = int(3.5 * size)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_store_many, args=(str(tmp_path), prefix, 15, limit)) for prefix in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0
    entries = graph_cache.cache_entries(str(tmp_path))
    assert 1 <= len(entries) <= 3 and _total(tmp_path) <= limit
    assert not list(tmp_path.glob("**/*.tmp"))
    for path in entries:
        assert GraphCache(str(tmp_path)).load(path.stem).nodes_after == 25_000  # each left whole


def _store_many(root: str, prefix: str, n: int, limit: int) -> None:
    cache = GraphCache(CacheFolder(root, max_bytes=limit))
    entry = _entry(25_000)
    for i in range(n):
        assert cache.store(_key(i, prefix), entry) is not None


def test_new_resolutions_of_an_ahead_of_time_module_stay_under_the_limit(tmp_path):
    """30 resolutions of a small block through aot_compile, with room for about three artifacts."""
    torch.manual_seed(0)
    block = WeightedBlock(16)
    limit = 1_200_000
    config = CompilationConfig(cache_dir=str(tmp_path), cache_max_bytes=limit)
    model = aot_compile(block, MindieSDBackend(config))
    lengths = range(1, 31)
    with torch.no_grad():
        for n in lengths:
            x = torch.randn(2, n, 16)
            assert_close(model(x), WeightedBlock.forward(block, x))
            assert _total(tmp_path) <= limit
    assert set(model.forward.outcomes.values()) == {"stored"}
    artifacts = graph_cache.artifact_files(str(tmp_path))
    assert 2 <= len(artifacts) <= 3
    assert stat.S_IMODE(artifacts[0].parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(artifacts[0].stat().st_mode) == 0o600
    del block.forward
    torch._dynamo.reset()
    again = aot_compile(block, MindieSDBackend(config))
    with torch.no_grad():
        again(torch.randn(2, lengths[-1], 16))  # the last one stored is there
        again(torch.randn(2, lengths[0], 16))  # the first was evicted
    assert list(again.forward.outcomes.values()) == ["loaded", "stored"]


def test_an_entry_larger_than_the_limit_is_kept_in_memory(tmp_path):
    torch.manual_seed(0)
    model, x = WeightedBlock(16), torch.randn(2, 8, 16)
    backend = MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path), cache_max_bytes=1000))
    with torch.no_grad(), pytest.warns(MindieSDCacheWarning, match="pass cache_max_bytes"):
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        assert_close(out, model(x))
    assert [r.cache for r in backend.report().records] == ["store failed"]
    assert graph_cache.cache_entries(str(tmp_path)) == []


def test_the_limit_is_not_in_the_key(tmp_path):
    torch.manual_seed(0)
    model, x = WeightedBlock(16), torch.randn(2, 8, 16)
    states = []
    for limit in (None, 10**9):
        torch._dynamo.reset()
        backend = MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path), cache_max_bytes=limit))
        with torch.no_grad():
            torch.compile(model, backend=backend, fullgraph=True)(x)
        states += [r.cache for r in backend.report().records]
    assert states == ["stored", "hit"]


def test_the_cache_command_shows_the_size_and_the_limit(tmp_path, monkeypatch, capsys):
    from mindiesd.__main__ import main

    GraphCache(str(tmp_path)).store(_key(1), _entry(2**18))
    assert main(["cache", "--cache-dir", str(tmp_path)]) == 0
    assert "1 entry (1 graph, 0 ahead-of-time artifacts), 1.0 MiB of 2048.0 MiB (cache_max_bytes)" in \
        capsys.readouterr().out
    monkeypatch.setattr(CompilationConfig, "cache_max_bytes", None)
    assert main(["cache", "--cache-dir", str(tmp_path)]) == 0
    assert "no limit (cache_max_bytes=None)" in capsys.readouterr().out
    tmp_path.chmod(0o777)
    assert main(["cache", "--cache-dir", str(tmp_path)]) == 0
    assert "not trusted" in capsys.readouterr().out


def test_bad_limits_are_refused():
    from mindiesd.compilation.config import SettingTypeError

    for bad in (0, -1, 1.5, "2G", True):
        with pytest.raises(SettingTypeError, match="cache_max_bytes must be None or a positive int"):
            CompilationConfig(cache_max_bytes=bad)


def test_temporary_files_count_toward_the_limit_and_stale_ones_are_removed(tmp_path):
    """A write in progress elsewhere (a young ``.tmp``) takes room the store must leave; one a killed writer left an
    hour ago is removed by the next store."""
    import os
    import time

    entry = _entry(20_000)
    size = len(graph_cache._encode(entry, _key(0)))
    cache = GraphCache(CacheFolder(tmp_path, max_bytes=int(2.5 * size)))
    assert cache.store(_key(0), entry) is not None and cache.store(_key(1), entry) is not None
    folder = graph_cache.cache_entries(str(tmp_path))[0].parent
    in_progress = folder / ".pending.abc.tmp"
    in_progress.write_bytes(b"\0" * size)
    stale = folder / ".crashed.def.tmp"
    stale.write_bytes(b"\0" * (3 * size))
    hour_ago = time.time() - graph_cache.STALE_TEMPORARY_SECONDS - 60
    os.utime(stale, (hour_ago, hour_ago))
    assert cache.store(_key(2), entry) is not None
    kept = {path.stem for path in graph_cache.cache_entries(str(tmp_path))}
    assert not stale.exists() and in_progress.exists()
    # two entries and the write in progress would pass 2.5 entries: the least recently used two went
    assert kept == {_key(2)}
