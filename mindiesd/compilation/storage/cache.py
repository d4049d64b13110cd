"""The persistent compile cache: what the backend made of a graph, on disk, for the next process.

A process that compiles a graph it has compiled before (in an earlier process, or before ``torch._dynamo.reset()``)
loads the fused aten graph and its fold graph instead of tracing through aot, freezing and the passes again.
Dynamo still traces the Python code in every new process: the cache starts where Dynamo hands the graph over.

**Key.** A sha256 over everything that can change what the backend produces:

- the entry format, mindiesd's version and a hash of its Python sources, torch's, diffusers' and Python's versions;
- the device kind (type; for an accelerator also its name and compute capability);
- the settings snapshot (all but :data:`_RUN_TIME_SETTINGS`, which change how the graph is run, logged or cached,
  not the graph) and the families skipped on the device, with the reason (so kernels registered later count);
- grad mode and autocast state;
- the code of the Dynamo graph (its submodules included) and the values of its tensor attributes;
- per example input: shape, strides, storage offset, dtype, device, ``requires_grad``, whether it is a parameter
  or buffer, and which inputs are the same tensor.

The values of parameters and buffers are not in the key: they are inputs of the cached graph, folded at run time
as in a fresh compile, so loading a checkpoint or hot-swapping a LoRA keeps the entry valid.

**Entries.** ``<cache_dir>/<key[:2]>/<key>.graph``: a header line (magic, format, key, payload size and sha256)
and the pickled payload (the graphs as their nodes, rebuilt without re-tracing their code). An entry is written to a
temporary file in the same folder and renamed into place, so a reader sees a whole entry or none, and two
processes writing one entry at once leave one whole entry. A file that is truncated, corrupt, written by another
format or stored under another key is ignored with a :class:`MindieSDCacheWarning` and the graph is compiled (and
the entry written) again.

**Trust.** Entries are Python pickles, and unpickling runs code: an entry is read only when it and every folder from
the cache folder down to it belong to this user (or root) and are writable by nobody else (a group of the owner
alone excepted), as ssh judges authorized_keys; no symbolic link below the cache folder is followed (the cache
folder's own path may pass through one: its target is checked). Each check is made on the opened file or folder
(``fstat`` of a descriptor opened with ``O_NOFOLLOW`` relative to its checked parent), so nothing can be swapped in
between. Anything else is not read, one :class:`MindieSDCacheWarning` per folder and reason says why, and nothing is
written there. ``cache_trust_foreign_owner`` accepts another user's files (a read-only cache shared on purpose).
Folders the cache makes are 0700, its files 0600.

**Size.** A store that would take the folder past ``cache_max_bytes`` first removes the least recently used graphs and
artifacts (a load sets a file's mtime: a use), under an ``flock`` of the folder's lock file, so processes sharing
the folder keep it under the limit together. Temporary files of writes in progress count toward the limit; one
older than an hour, left by a write that never finished, is removed by the next store.

**Symbolic sizes** (``dynamic=True``, automatic dynamic): the key names each size by its source and holds the
guards Dynamo made on them; the shape guards the compile adds are stored with the entry and replayed on a load,
where an entry whose guards the sizes at hand fail is a miss (:mod:`.sizes`).

**Not cached** (compiled as without a cache; the graph's ``record.cache`` says why): training graphs, graphs under
autocast, graphs whose compile guards a size computed inside the graph, and graphs whose calling
convention aot changes (input mutations, outputs that alias an input or an intermediate, duplicated inputs,
tensor subclasses, effect tokens).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.fx import GraphModule

from . import stored_graph
from .symbolic_sizes import SymbolicSizes
from ...files.trust import (  # noqa: F401  (public here as before: graph_cache.untrusted_reason)
    UntrustedPath, check_replaceable, ownership_fault, make_folder, open_file, open_folder, private_group,
    untrusted_reason,
)

log = logging.getLogger("mindiesd.compilation")

__all__ = [
    "MindieSDCacheWarning", "CachedGraph", "GraphCache", "CacheFolder", "UntrustedPath", "untrusted_reason",
    "cache_entries", "clear_cache", "describe", "FORMAT",
]

#: Version of the entry layout; entries of another format are ignored.
FORMAT = 2
_MAGIC = b"MINDIESD-GRAPH-CACHE"
_SUFFIX = ".graph"


class MindieSDCacheWarning(UserWarning):
    """A cache entry could not be read or written; the graph is compiled as without a cache."""


@dataclass
class CachedGraph:
    """What the backend produced for one graph: enough to run it and to report on it without compiling."""

    main: GraphModule
    fold: Optional[GraphModule] = None
    fold_inputs: List[int] = field(default_factory=list)
    main_inputs: List[int] = field(default_factory=list)
    n_folded: int = 0
    matches: Dict[str, int] = field(default_factory=dict)
    rules: Dict[str, int] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    nodes_after: int = 0
    #: The traced facts of ``main``'s nodes that its runners may call straight on their C++ entries (output dtype
    #: and memory order, ``lowering.traced_facts``): a loaded graph's nodes carry no traced values.
    facts: Dict[str, Any] = field(default_factory=dict)
    #: The runner's compiled code (``python_runner.compiled_code``), or None: a load then compiles the generated
    #: text.
    runner_code: Optional[Tuple[str, bytes]] = None
    #: What each measured fused op site runs, with the candidates' times (``kernel_choice``), for the report.
    kernel_choices: List[str] = field(default_factory=list)
    #: The shape guards the compile added, over source names (``symbolic_sizes.SymbolicSizes``): replayed on a load.
    guards: List[Any] = field(default_factory=list)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["main"] = stored_graph.state_of(self.main)
        state["fold"] = None if self.fold is None else stored_graph.state_of(self.fold)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        state.setdefault("facts", state.pop("direct", {}))  # "direct" in entries of earlier versions
        state.setdefault("guards", [])
        state.setdefault("runner_code", None)
        state.setdefault("kernel_choices", [])
        state["main"] = stored_graph.graph_module(state["main"])
        state["fold"] = None if state["fold"] is None else stored_graph.graph_module(state["fold"])
        self.__dict__.update(state)

    def check(self) -> None:
        """Raise ValueError when the parts do not fit together (a corrupt or foreign payload)."""
        if not isinstance(self.main, GraphModule) or not (self.fold is None or isinstance(self.fold, GraphModule)):
            raise ValueError("the payload holds no graph")
        placeholders = stored_graph.placeholders(self.main)
        if self.fold is None:
            return
        fold_placeholders = stored_graph.placeholders(self.fold)
        if fold_placeholders != len(self.fold_inputs) or placeholders != self.n_folded + len(self.main_inputs):
            raise ValueError("the fold and main graphs do not fit their input lists")


# ------------------------------------------------------------------------------------------------ the key


_SOURCE_HASH: Optional[str] = None


def _source_hash(root: Optional[Path] = None) -> str:
    """sha256 of the product's sources under ``root`` (default: the installed package): its ``__init__.py``, the
    Python of ``compilation/``, ``ops/`` and ``files/`` and the ops' C++; a changed pass or op schema makes earlier
    entries stale, a changed bench or zoo model does not."""
    global _SOURCE_HASH
    if root is None and _SOURCE_HASH is not None:
        return _SOURCE_HASH
    package = Path(__file__).resolve().parents[2] if root is None else Path(root)
    patterns = ("__init__.py", "compilation/**/*.py", "ops/**/*.py", "files/**/*.py", "ops/**/*.cpp", "ops/**/*.h")
    digest = hashlib.sha256()
    for path in sorted({path for pattern in patterns for path in package.glob(pattern)}):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    if root is not None:
        return digest.hexdigest()
    _SOURCE_HASH = digest.hexdigest()
    return _SOURCE_HASH


@functools.lru_cache(maxsize=None)
def _installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` ("-": none); read once per process (reading the metadata takes
    milliseconds, and a key is made per graph and per compiled block)."""
    try:
        from importlib.metadata import version

        return version(distribution)
    except Exception:  # not installed
        return "-"


def _versions() -> Dict[str, str]:
    import mindiesd

    diffusers = _installed_version("diffusers")
    return {
        "format": str(FORMAT), "mindiesd": mindiesd.__version__, "sources": _source_hash(), "torch": torch.__version__,
        "diffusers": diffusers, "python": platform.python_version(),
    }


def device_kind(device: Optional[torch.device]) -> str:
    """The device type, and for an accelerator its name and compute capability."""
    if device is None:
        return "none"
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{torch.cuda.get_device_name(index)}:sm{major}{minor}"
    if device.type == "npu":
        try:
            return f"npu:{torch.npu.get_device_name(device.index or 0)}"  # type: ignore[attr-defined]
        except Exception:
            return "npu"
    return device.type


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _graph_text(gm: torch.nn.Module, digest: "hashlib._Hash") -> None:
    """The code of ``gm`` and of its graph submodules, and the values of its tensor attributes."""
    for name, module in sorted(gm.named_modules(), key=lambda item: item[0]):
        digest.update(f"module {name} {type(module).__name__}\n".encode())
        if isinstance(module, GraphModule):
            digest.update(module.code.encode())
        for attr, value in sorted(vars(module).get("_parameters", {}).items()) + sorted(
            vars(module).get("_buffers", {}).items()
        ):
            if value is not None:
                digest.update(f"tensor {attr} {_tensor_meta(value)}\n".encode())
                digest.update(_tensor_bytes(value))
    if isinstance(gm, GraphModule):
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = _get_attr(gm, node.target)
                if isinstance(value, torch.Tensor):
                    digest.update(f"constant {node.target} {_tensor_meta(value)}\n".encode())
                    digest.update(_tensor_bytes(value))


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _tensor_meta(t: torch.Tensor, weight: bool = False, text: Callable[[Any], str] = str) -> str:
    # a weight's place in its storage does not change the graph (merged projections make weights views of one
    # buffer after the first fold): the key of a process that folded already equals that of a fresh one
    offset = "-" if weight else text(t.storage_offset())
    shape, stride = ", ".join(map(text, t.shape)), ", ".join(map(text, t.stride()))
    return f"({shape}) ({stride}) {offset} {t.dtype} {t.device.type} {t.requires_grad} {type(t).__name__}"


def _is_symbolic(value: Any) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset()))
    return False


def uncacheable_inputs(example_inputs: Sequence[Any]) -> Optional[str]:
    """Why a graph with these inputs is not cached, or None."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if any(isinstance(v, torch.Tensor) and is_traceable_wrapper_subclass(v) for v in example_inputs):
        return "tensor subclass input"
    if torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"):
        return "autocast"
    return None


def graph_key(gm: GraphModule, example_inputs: Sequence[Any], weights: Iterable[int], settings: Dict[str, Any],
              device: Optional[torch.device], skipped: Dict[str, str], sizes: Optional["SymbolicSizes"] = None) -> str:
    """The entry key of ``gm`` compiled for these inputs with these settings on this device (``sizes``: their
    symbolic sizes, named by source)."""
    text = sizes.text if sizes is not None else str
    digest = hashlib.sha256()
    digest.update(json.dumps(_versions(), sort_keys=True).encode())
    digest.update(f"device {device_kind(device)}\n".encode())
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(json.dumps(skipped, sort_keys=True).encode())
    digest.update(f"grad {torch.is_grad_enabled()}\n".encode())
    _graph_text(gm, digest)
    weight_set = set(weights)
    first_of: Dict[int, int] = {}
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.Tensor):
            same = first_of.setdefault(id(value), i)
            weight = i in weight_set
            if sizes is not None and isinstance(sizes.traced[i], torch.Tensor):
                value = sizes.traced[i]  # the sizes as traced: symbols where Dynamo made them symbolic
            digest.update(f"input {i} {_tensor_meta(value, weight, text)} weight={weight} same={same}\n".encode())
        elif _is_symbolic(value):
            digest.update(f"input {i} {type(value).__name__} {text(value)}\n".encode())
        else:
            digest.update(f"input {i} {type(value).__name__} {value!r}\n".encode())
    for line in sizes.key_lines() if sizes is not None else ():
        digest.update(f"{line}\n".encode())
    return digest.hexdigest()


def calling_convention_problem(aten_gm: GraphModule, n_inputs: int) -> Optional[str]:
    """Why aot's runtime wrapper does more for this inference graph than calling it (so it is not cached)."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    if meta is None:
        return "no aot metadata"
    if any(info.mutates_data or info.mutates_metadata for info in meta.input_info):
        return "input mutation"
    if any(info.output_type.name != "non_alias" for info in meta.output_info):
        return "an output aliases an input or an intermediate"
    if meta.num_intermediate_bases or getattr(meta, "tokens", None):
        return "intermediate bases or effect tokens"
    from ..fx_utils import subclass_parts

    if subclass_parts(aten_gm.graph):
        return "a tensor-subclass input (aot unwraps it on every call)"
    placeholders = sum(1 for n in aten_gm.graph.nodes if n.op == "placeholder")
    if placeholders != n_inputs:
        return "aot changed the inputs (duplicates or lifted attributes)"
    outputs = next(n for n in reversed(aten_gm.graph.nodes) if n.op == "output").args[0]
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(meta.output_info):
        return "aot changed the outputs"
    return None


def runnable(entry: CachedGraph) -> Callable[..., Any]:
    """The callable Dynamo gets from a cache hit: the graphs on the flat inputs, without gradients (as aot runs
    an inference graph)."""
    from ..runtime.executor import runner
    from ..freezing import FrozenGraph

    if entry.fold is not None:
        frozen = FrozenGraph(entry.fold, entry.main, list(entry.fold_inputs), list(entry.main_inputs), entry.n_folded)
        run_graph = frozen.bind(runner(entry.main, entry.facts, entry.runner_code))
    else:
        frozen, run_graph = None, runner(entry.main, entry.facts, entry.runner_code)
    run = inference_call(run_graph)
    run.frozen = frozen  # type: ignore[attr-defined]
    return run


def inference_call(run_graph: Callable[..., Any]) -> Callable[..., Any]:
    """``run_graph`` called as aot calls an inference graph whose calling convention it leaves as it is (no
    input mutation, no aliased output: :func:`calling_convention_problem`): without gradients."""
    from ..runtime.executor import BoundCall, CppRunner

    if isinstance(run_graph, (BoundCall, CppRunner)):  # the program switches grad mode itself
        return run_graph.inference()

    def run(*args: Any) -> Any:
        with torch.no_grad():
            return run_graph(*args)

    return run


# ------------------------------------------------------------------------------------------ trusted folders


# UntrustedPath, untrusted_reason and the checked opens live in ``files/trust.py`` (the C++ kernels' build cache
# makes the same check before it imports a built module).


#: (folder, reason) pairs already warned about in this process: one warning each, not one per file and call.
_WARNED: set = set()


def _warn_once(folder: str, reason: str, message: str) -> None:
    if (folder, reason) not in _WARNED:
        _WARNED.add((folder, reason))
        _warn(message)


def _warn_untrusted(exc: UntrustedPath, doing: str) -> None:
    folder = exc.path if os.path.isdir(exc.path) else os.path.dirname(exc.path)
    _warn_once(folder, exc.reason, f"not {doing} {exc.path}: it {exc.reason}; the graph is compiled and kept in "
                                   "memory for this process, and nothing is written there")


# ------------------------------------------------------------------------------------------------ the store


def _warn(message: str) -> None:
    warnings.warn(f"mindiesd cache: {message}", MindieSDCacheWarning, stacklevel=4)


class GraphCache:
    """Entries of one cache folder (a path: the default rules; a :class:`CacheFolder`: its settings)."""

    def __init__(self, root: Union[str, Path, "CacheFolder"]):
        self.folder = root if isinstance(root, CacheFolder) else CacheFolder(root)
        self.root = self.folder.root

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{_SUFFIX}"

    def load(self, key: str) -> Optional[CachedGraph]:
        """The entry stored under ``key``; None when there is none or it is unusable or untrusted (with a
        warning)."""
        path = self.path(key)
        try:
            data = self.folder.read(path)
        except OSError as exc:
            _warn(f"cannot read {path} ({exc}); compiling")
            return None
        if data is None:
            return None
        try:
            entry = _decode(data, key)
        except Exception as exc:
            _warn(f"ignoring the unusable entry {path} ({type(exc).__name__}: {exc}); compiling again")
            return None
        log.debug("cache hit %s", path)
        return entry

    def store(self, key: str, entry: CachedGraph) -> Optional[Path]:
        """Write ``entry`` atomically; returns the path, or None (with a warning) when it cannot be written."""
        path = self.path(key)
        try:
            data = _encode(entry, key)
            if not self.folder.write(path, data):
                return None
        except Exception as exc:
            _warn(f"cannot write {path} ({type(exc).__name__}: {exc}); the graph is compiled again next time")
            return None
        log.debug("cache store %s (%d bytes)", path, len(data))
        return path


class CacheFolder:
    """One cache folder as the graph cache and the ahead-of-time artifacts use it: a file is read only when it and
    its folders are trusted (:func:`untrusted_reason`), written only into folders this user owns, and the folder
    kept under ``max_bytes`` by removing the least recently used files (None: no limit; :meth:`of` applies the
    settings)."""

    def __init__(self, root: Any, trust_foreign_owner: bool = False, max_bytes: Optional[int] = None):
        self.root = Path(root).expanduser()
        self.trust_foreign_owner, self.max_bytes = trust_foreign_owner, max_bytes

    @classmethod
    def of(cls, config: Any) -> Optional["CacheFolder"]:
        """The cache folder of a :class:`~mindiesd.compilation.config.CompilationConfig` (None: the cache is off)."""
        if not config.cache_dir:
            return None
        return cls(config.cache_dir, config.cache_trust_foreign_owner, config.cache_max_bytes)

    def read(self, path: Path) -> Optional[bytes]:
        """The bytes of the file ``path`` of this folder, its use recorded when it is this user's (its mtime: what
        eviction orders by); None when there is none, or when it is not trusted (one warning per folder and
        reason)."""
        try:
            fd = open_file(self.root, path.relative_to(self.root).parts, self.trust_foreign_owner)
        except UntrustedPath as exc:
            _warn_untrusted(exc, "reading")
            return None
        except (FileNotFoundError, NotADirectoryError):
            return None
        if os.fstat(fd).st_uid == os.getuid():
            with contextlib.suppress(OSError):
                os.utime(fd)
        with os.fdopen(fd, "rb") as fh:
            return fh.read()

    def write(self, path: Path, data: bytes) -> bool:
        """Write ``data`` to the file ``path`` of this folder atomically, making its folders (mode 0700) and room
        under the limit; False (with one warning per folder and reason) when a folder on the way is not this
        user's to write into or ``data`` alone passes the limit. Raises OSError when the write itself fails."""
        parts = path.relative_to(self.root).parts
        try:
            folder = open_folder(self.root, parts[:-1], False, create=True)
            try:
                check_replaceable(parts[-1], folder, str(path))
            finally:
                os.close(folder)
        except UntrustedPath as exc:
            _warn_untrusted(exc, "writing into")
            return False
        if self.max_bytes is not None and len(data) > self.max_bytes:
            _warn_once(str(self.root), "too large", f"not storing {path.name}: its {len(data)} bytes pass "
                       f"cache_max_bytes ({self.max_bytes}); it is kept in memory for this process")
            return False
        with self._locked():
            self._make_room(len(data), path)
            write_atomic(path, data)
        return True

    def _make_room(self, incoming: int, replaced: Path) -> None:
        """Remove the least recently used entries and artifacts until ``incoming`` more bytes fit under the limit
        (``replaced``, which the new file replaces, counts as gone). Another process may remove or replace a file
        meanwhile: a file gone is skipped, and a reader that opened it keeps reading it."""
        if self.max_bytes is None:
            return
        stored = []
        writing = 0  # temporary files of writes in progress (in another process): their bytes count, they stay
        now = time.time()
        for path in _files(str(self.root), _holds_entries, ".tmp"):
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                if now - st.st_mtime > STALE_TEMPORARY_SECONDS and _remove(path):
                    log.debug("cache removed %s, left by a write that did not finish", path)
                else:
                    writing += st.st_size
        for path in cache_entries(str(self.root)):
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                if path != replaced:
                    stored.append((st.st_mtime_ns, st.st_size, path))
        total = incoming + writing + sum(size for _, size, _ in stored)
        for _, size, path in sorted(stored):
            if total <= self.max_bytes:
                return
            if _remove(path):
                total -= size
                log.debug("cache evicted %s (%d bytes)", path, size)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The folder's lock file held while it is trimmed and written, so that processes sharing it keep it under
        the limit together; where no lock can be taken (no fcntl, a read-only folder) the store goes unlocked."""
        try:
            import fcntl

            fd = os.open(self.root / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except (ImportError, OSError):
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


#: The lock file of a cache folder (:meth:`CacheFolder._locked`).
_LOCK_FILE = ".lock"

#: A temporary file of :func:`write_atomic` this old was left by a write that did not finish (a killed process):
#: the next store removes it. A younger one is a write in progress elsewhere; its bytes count toward the limit.
STALE_TEMPORARY_SECONDS = 3600


def _remove(path: Path) -> bool:
    """Unlink ``path``; False when it cannot be (True when another process removed it first)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder renamed into place, so a reader sees
    a whole file or none (and two writers leave one whole file)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _ignored():
            os.unlink(tmp)
        raise


class _ignored:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return True


def frame(payload: bytes, key: str) -> bytes:
    """``payload`` behind a header line (magic, format, key, size and sha256) that :func:`unframe` checks."""
    header = {"format": FORMAT, "key": key, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    return _MAGIC + b" " + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def unframe(data: bytes, key: str) -> bytes:
    """The payload of ``data`` written by :func:`frame` under ``key``; ValueError saying what is wrong with it
    (not an entry, another format or key, truncated, corrupt)."""
    line, sep, payload = data.partition(b"\n")
    if not sep or not line.startswith(_MAGIC + b" "):
        raise ValueError("not a mindiesd cache entry")
    header = json.loads(line[len(_MAGIC) + 1:].decode())
    if header.get("format") != FORMAT:
        raise ValueError(f"entry format {header.get('format')!r}, this mindiesd reads {FORMAT}")
    if header.get("key") != key:
        raise ValueError("the entry was stored under another key")
    if header.get("size") != len(payload):
        raise ValueError(f"truncated: {len(payload)} of {header.get('size')} bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("checksum mismatch")
    return payload


def _encode(entry: CachedGraph, key: str) -> bytes:
    return frame(pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL), key)


def _decode(data: bytes, key: str) -> CachedGraph:
    entry = pickle.loads(unframe(data, key))
    if not isinstance(entry, CachedGraph):
        raise ValueError(f"the payload is a {type(entry).__name__}")
    entry.check()
    return entry


def cache_entries(folder: Optional[str]) -> List[Path]:
    """The entry files of the cache ``folder`` (None: the cache is off, no entries): the graphs and the
    ahead-of-time artifacts (:func:`artifact_files`)."""
    return _files(folder, _holds_graphs, _SUFFIX) + artifact_files(folder)


#: The folder of the ahead-of-time artifacts (:mod:`mindiesd.compilation.ahead_of_time`) in a cache folder, and their suffix.
ARTIFACT_FOLDER = "aot"
ARTIFACT_SUFFIX = ".aot"


def artifact_files(folder: Optional[str]) -> List[Path]:
    """The ahead-of-time artifact files of the cache ``folder``."""
    return _files(folder, lambda name: name == ARTIFACT_FOLDER, ARTIFACT_SUFFIX)


def _holds_graphs(name: str) -> bool:
    return len(name) == 2


def _holds_entries(name: str) -> bool:
    return _holds_graphs(name) or name == ARTIFACT_FOLDER


def _files(folder: Optional[str], holds_entries: Callable[[str], bool], suffix: str) -> List[Path]:
    """The regular files ending in ``suffix`` in the subfolders of ``folder`` that ``holds_entries`` names; symbolic
    links are not followed, so listing, clearing and evicting never reach outside the cache folder."""
    root = _root(folder)
    found = []
    for sub in _listing(root) if root is not None else []:
        if sub.is_dir(follow_symlinks=False) and holds_entries(sub.name):
            found += [Path(f.path) for f in _listing(Path(sub.path))
                      if f.name.endswith(suffix) and f.is_file(follow_symlinks=False)]
    return sorted(found)


def _listing(folder: Path) -> List[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


def clear_cache(folder: Optional[str]) -> int:
    """Delete every entry and artifact (and leftover temporary file) of the cache ``folder``; returns how many were
    removed."""
    root = _root(folder)
    if root is None or not root.is_dir():
        return 0
    removed = 0
    leftovers = _files(folder, _holds_entries, ".tmp")
    for path in cache_entries(folder) + leftovers:
        with _ignored():
            path.unlink()
            removed += path.suffix in (_SUFFIX, ARTIFACT_SUFFIX)
    for sub in _listing(root):
        if sub.is_dir(follow_symlinks=False) and _holds_entries(sub.name):
            with _ignored():
                os.rmdir(sub.path)
    return removed


def _root(folder: Optional[str]) -> Optional[Path]:
    return Path(folder).expanduser() if folder else None


def settings_for_key(settings: Dict[str, Any]) -> Dict[str, Any]:
    """The settings that can change the compiled graph."""
    return {k: v for k, v in settings.items() if k not in _RUN_TIME_SETTINGS}


#: Settings that change how the compiled graph is run, logged or cached, not the graph.
_RUN_TIME_SETTINGS = ("cache_dir", "cache_max_bytes", "cache_trust_foreign_owner", "graph_log_url", "strict",
                      "aclgraph_max_graphs", "safe_output_mode")


def describe(folder: Optional[str]) -> Tuple[Optional[Path], int, int]:
    """(folder, entries, bytes) of the cache ``folder`` (None: the cache is off)."""
    entries = cache_entries(folder)
    return _root(folder), len(entries), sum(p.stat().st_size for p in entries)
