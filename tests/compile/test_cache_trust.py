"""The cache reads only what it can trust (docs/cache.md, "Trusted folders").

What a user checks: an entry or artifact in a folder that another user owns, or that group or others can write, or
reached through a symbolic link below the cache folder, is never unpickled (a planted payload, framed so that its
magic, key, size and checksum all pass, does not run); one warning names the path and why; the graph is compiled,
gives eager's output and nothing is written there. The user's own entries still load, from folders made 0700, and
``cache_trust_foreign_owner`` reads a cache shared on purpose.
"""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import warnings
from pathlib import Path

import pytest
import torch

from fusion_utils import WeightedBlock, assert_close
from mindiesd.compilation import CompilationConfig, MindieSDBackend, MindieSDCacheWarning
from mindiesd.compilation.storage import cache as graph_cache
from mindiesd.compilation import config as config_module

FOREIGN_UID = 12345
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")


class _Planted:
    """A payload whose unpickling makes the folder ``marker``: proof that a file was unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _plant(path: Path, marker: Path) -> None:
    """Replace the entry or artifact ``path`` by a payload that passes every check of its frame."""
    path.write_bytes(graph_cache.frame(pickle.dumps(_Planted(marker)), path.stem))


def _tree(folder: Path) -> dict:
    """Every file and folder under ``folder`` (links not followed) with its status, to see that nothing changed."""
    found = {}
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            st = os.lstat(os.path.join(parent, name))
            found[os.path.join(parent, name)] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns)
    return found


def _compile(model, x, cache_dir, **settings):
    torch._dynamo.reset()
    backend = MindieSDBackend(CompilationConfig(cache_dir=str(cache_dir), **settings))
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
    return out, [r.cache for r in backend.report().records]


def _cache_warnings(caught) -> list:
    return [str(w.message) for w in caught if issubclass(w.category, MindieSDCacheWarning)]


@pytest.fixture
def block():
    torch.manual_seed(0)
    return WeightedBlock(16), torch.randn(2, 8, 16)


def _make_untrusted(how: str, root: Path, entry: Path, elsewhere: Path) -> str:
    """Make ``entry`` (in ``root``) untrusted in the way ``how`` names; returns the path the warning names."""
    if how == "world_writable_root":
        root.chmod(0o777)
        return str(root)
    if how == "group_writable_folder":
        os.chown(entry.parent, -1, FOREIGN_UID)  # a group shared with others, not the owner's private one
        entry.parent.chmod(0o770)
        return str(entry.parent)
    if how == "foreign_owner":
        os.chown(entry, FOREIGN_UID, FOREIGN_UID)
        return str(entry)
    if how == "symlinked_entry":
        elsewhere.mkdir(mode=0o700)
        shutil.move(entry, elsewhere / entry.name)
        entry.symlink_to(elsewhere / entry.name)
        return str(entry)
    assert how == "symlinked_folder"
    shutil.move(entry.parent, elsewhere)
    entry.parent.symlink_to(elsewhere)
    return str(entry.parent)


@pytest.mark.parametrize("how", [
    "world_writable_root", pytest.param("group_writable_folder", marks=as_root),
    pytest.param("foreign_owner", marks=as_root), "symlinked_entry", "symlinked_folder"])
def test_an_untrusted_entry_is_not_unpickled(tmp_path, block, how):
    model, x = block
    with torch.no_grad():
        expected = model(x)
    root, marker, elsewhere = tmp_path / "cache", tmp_path / "marker", tmp_path / "elsewhere"
    assert _compile(model, x, root)[1] == ["stored"]
    (entry,) = graph_cache.cache_entries(str(root))
    _plant(entry, marker)
    named = _make_untrusted(how, root, entry, elsewhere)
    before = {**_tree(root), **_tree(elsewhere)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, states = _compile(model, x, root)
        again, _ = _compile(model, x, root)  # a second compile in the process warns no more
    assert not marker.exists(), "the planted payload ran"
    messages = _cache_warnings(caught)
    assert len(messages) == 1 and named in messages[0] and "compiled and kept in memory" in messages[0], messages
    assert states == ["store failed"]
    assert_close(out, expected)
    assert_close(again, expected)
    assert {**_tree(root), **_tree(elsewhere)} == before, "something was written into the untrusted folder"


def test_the_reasons_name_the_rule(tmp_path):
    root = tmp_path / "cache"
    (root / "ab").mkdir(parents=True, mode=0o700)
    entry = root / "ab" / "entry.graph"
    entry.write_bytes(b"x")
    assert graph_cache.untrusted_reason(entry, root) is None
    root.chmod(0o757)
    assert "writable by others (mode 0757" in graph_cache.untrusted_reason(entry, root)
    root.chmod(0o700)
    (root / "ab" / "link.graph").symlink_to(entry)
    assert "symbolic link" in graph_cache.untrusted_reason(root / "ab" / "link.graph", root)
    fifo = root / "ab" / "fifo.graph"
    os.mkfifo(fifo, 0o600)
    assert "not a regular file" in graph_cache.untrusted_reason(fifo, root)


def test_a_folder_writable_by_the_owners_private_group_is_accepted(tmp_path):
    """A umask of 002 makes folders group-writable; a group of the owner alone (Debian's user private group) is
    as good as the owner, as Debian's sshd judges it."""
    if not graph_cache.private_group(os.getuid(), os.getgid()):
        pytest.skip("this user's primary group is not a private one")
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    os.chown(root, -1, os.getgid())
    root.chmod(0o770)
    assert graph_cache.untrusted_reason(root, root) is None
    root.chmod(0o777)
    assert "writable by others" in graph_cache.untrusted_reason(root, root)


def test_listing_and_clearing_do_not_follow_a_symbolic_link(tmp_path):
    root, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    (root / graph_cache.ARTIFACT_FOLDER).mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / f"{'ab' * 32}.graph").write_bytes(b"someone else's")
    (root / "ab").symlink_to(elsewhere)
    (root / graph_cache.ARTIFACT_FOLDER / f"{'cd' * 32}.aot").symlink_to(elsewhere / f"{'ab' * 32}.graph")
    assert graph_cache.cache_entries(str(root)) == []
    graph_cache.clear_cache(str(root))
    assert (elsewhere / f"{'ab' * 32}.graph").read_bytes() == b"someone else's"


def test_the_root_may_be_reached_through_a_symbolic_link(tmp_path, block):
    """The folder the settings name may be a link (a cache on another disk): its target is checked."""
    model, x = block
    (tmp_path / "disk").mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(tmp_path / "disk")
    assert _compile(model, x, tmp_path / "cache")[1] == ["stored"]
    assert _compile(model, x, tmp_path / "cache")[1] == ["hit"]


def test_own_entries_load_from_private_folders(tmp_path, block):
    model, x = block
    root = tmp_path / "a" / "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDCacheWarning)
        assert _compile(model, x, root)[1] == ["stored"]
        out, states = _compile(model, x, root)
    assert states == ["hit"]
    with torch.no_grad():
        assert_close(out, model(x))
    (entry,) = graph_cache.cache_entries(str(root))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(entry.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600


def _foreign_read_only(root: Path) -> None:
    """Give the cache folder to another user, readable by all and writable by none but its owner (an image's)."""
    for parent, dirs, files in os.walk(root):
        os.chown(parent, FOREIGN_UID, FOREIGN_UID)
        os.chmod(parent, 0o755)
        for name in files:
            os.chown(os.path.join(parent, name), FOREIGN_UID, FOREIGN_UID)
            os.chmod(os.path.join(parent, name), 0o644)


@as_root
@pytest.mark.parametrize("opt_in", ["setting", "environment"])
def test_trusting_a_foreign_owner_reads_a_shared_read_only_cache(tmp_path, block, monkeypatch, opt_in):
    model, x = block
    root = tmp_path / "cache"
    _compile(model, x, root)
    _foreign_read_only(root)
    with pytest.warns(MindieSDCacheWarning, match=f"owned by uid {FOREIGN_UID}"):
        assert _compile(model, x, root)[1] == ["store failed"]
    if opt_in == "setting":
        settings = {"cache_trust_foreign_owner": True}
    else:
        monkeypatch.setenv(config_module.TRUST_ENV_VAR, "1")
        CompilationConfig.reset()
        settings = {}
    before = _tree(root)
    out, states = _compile(model, x, root, **settings)
    assert states == ["hit"]
    with torch.no_grad():
        assert_close(out, model(x))
    other = torch.randn(3, 8, 16)  # a new shape: compiled, and not written into the other user's folder
    monkeypatch.setattr(graph_cache, "_WARNED", set())  # as in a process that read the folder only
    with pytest.warns(MindieSDCacheWarning, match="not writing into"):
        assert _compile(model, other, root, **settings)[1] == ["store failed"]
    assert _tree(root) == before


@as_root
def test_trusting_a_foreign_owner_still_refuses_what_others_can_write(tmp_path, block):
    model, x = block
    root = tmp_path / "cache"
    _compile(model, x, root)
    (entry,) = graph_cache.cache_entries(str(root))
    _plant(entry, tmp_path / "marker")
    _foreign_read_only(root)
    entry.chmod(0o666)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compile(model, x, root, cache_trust_foreign_owner=True)
    assert not (tmp_path / "marker").exists()
    reading, writing = _cache_warnings(caught)
    assert f"not reading {entry}: it is writable by group and others" in reading
    assert f"not writing into {root}: it is owned by uid {FOREIGN_UID}" in writing


def test_the_trust_setting_is_not_in_the_key(tmp_path, block):
    model, x = block
    _compile(model, x, tmp_path)
    assert _compile(model, x, tmp_path, cache_trust_foreign_owner=True)[1] == ["hit"]


# ------------------------------------------------------------------------------- ahead-of-time artifacts


@as_root
def test_an_untrusted_artifact_is_not_unpickled(tmp_path):
    """tiny Flux through aot_compile: a foreign artifact with a planted payload, in the place the key selects."""
    pytest.importorskip("diffusers")
    from mindiesd import zoo
    from mindiesd.compilation import aot_compile

    def run(folder):
        torch._dynamo.reset()
        case = zoo.build("flux", "tiny", seed=0)
        model = aot_compile(case.model, MindieSDBackend(CompilationConfig(cache_dir=str(folder))))
        with torch.no_grad():
            expected = type(case.model).forward(case.model, **case.inputs)[0]
            return model(**case.inputs)[0], expected, model.forward

    run(tmp_path / "cache")
    (artifact,) = graph_cache.artifact_files(str(tmp_path / "cache"))
    marker = tmp_path / "marker"
    _plant(artifact, marker)
    os.chown(artifact, FOREIGN_UID, FOREIGN_UID)
    before = _tree(tmp_path / "cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, expected, forward = run(tmp_path / "cache")
    assert not marker.exists(), "the planted payload ran"
    messages = _cache_warnings(caught)
    assert len(messages) == 1 and str(artifact) in messages[0] and f"uid {FOREIGN_UID}" in messages[0], messages
    assert list(forward.outcomes.values()) == ["compiled"]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert _tree(tmp_path / "cache") == before
