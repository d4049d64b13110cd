"""The persistent compile cache: what the backend made of a graph, on disk, for the next process.

A process that compiles a graph it has compiled before (in an earlier process, or before ``torch._dynamo.reset()``)
loads the fused aten graph and its fold graph instead of tracing through aot, freezing and the passes again.
Dynamo still traces the Python code in every new process: the cache starts where Dynamo hands the graph over.

**Key.** A sha256 over everything that can change what the backend produces:

- the entry format, mindiesd's version and a hash of its Python sources, torch's, diffusers' and Python's versions;
- the device kind (type; for an accelerator also its name and compute capability);
- the settings snapshot (all but ``cache_dir``, ``graph_log_url``, ``strict``, ``aclgraph_max_graphs`` and
  ``safe_output_mode``, which change how the graph is run or logged, not the graph) and the families skipped on the device, with the reason (so kernels registered later count);
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
the entry written) again. Entries are Python pickles: like Inductor's cache, the folder must be trusted (it is the
user's own by default).

**Not cached** (compiled as without a cache; the graph's ``record.cache`` says why): graphs with symbolic shapes
(their guards come from the compile), training graphs, graphs under autocast, and graphs whose calling
convention aot changes (input mutations, outputs that alias an input or an intermediate, duplicated inputs,
tensor subclasses, effect tokens).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.fx import GraphModule

from . import stored_graph

log = logging.getLogger("mindiesd.compilation")

__all__ = [
    "MindieSDCacheWarning", "CachedGraph", "GraphCache", "cache_entries", "clear_cache", "describe", "FORMAT",
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
    #: The fused ops of ``main`` whose C++ kernels its runner may call straight (``codegen.traced_facts``).
    direct: Dict[str, torch.dtype] = field(default_factory=dict)
    #: The runner's compiled code (``codegen.compiled_code``), or None: a load then compiles the generated text.
    runner_code: Optional[Tuple[str, bytes]] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["main"] = stored_graph.state_of(self.main)
        state["fold"] = None if self.fold is None else stored_graph.state_of(self.fold)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        state.setdefault("direct", {})  # stored before the runner existed: its fused ops use the dispatcher
        state.setdefault("runner_code", None)
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
    Python of ``compilation/`` and ``ops/`` and the ops' C++; a changed pass or op schema makes earlier entries
    stale, a changed bench or zoo model does not."""
    global _SOURCE_HASH
    if root is None and _SOURCE_HASH is not None:
        return _SOURCE_HASH
    package = Path(__file__).resolve().parent.parent if root is None else Path(root)
    patterns = ("__init__.py", "compilation/**/*.py", "ops/**/*.py", "ops/**/*.cpp", "ops/**/*.h")
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


def _tensor_meta(t: torch.Tensor, weight: bool = False) -> str:
    # a weight's place in its storage does not change the graph (merged projections make weights views of one
    # buffer after the first fold): the key of a process that folded already equals that of a fresh one
    offset = "-" if weight else t.storage_offset()
    return (f"{tuple(t.shape)} {tuple(t.stride())} {offset} {t.dtype} {t.device.type} "
            f"{t.requires_grad} {type(t).__name__}")


def _is_symbolic(value: Any) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset()))
    return False


def uncacheable_inputs(example_inputs: Sequence[Any]) -> Optional[str]:
    """Why a graph with these inputs is not cached, or None."""
    if any(_is_symbolic(v) for v in example_inputs):
        return "symbolic shapes"
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if any(isinstance(v, torch.Tensor) and is_traceable_wrapper_subclass(v) for v in example_inputs):
        return "tensor subclass input"
    if torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"):
        return "autocast"
    return None


def graph_key(gm: GraphModule, example_inputs: Sequence[Any], weights: Iterable[int], settings: Dict[str, Any],
              device: Optional[torch.device], skipped: Dict[str, str]) -> str:
    """The entry key of ``gm`` compiled for these inputs with these settings on this device."""
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
            digest.update(f"input {i} {_tensor_meta(value, weight)} weight={weight} same={same}\n".encode())
        else:
            digest.update(f"input {i} {type(value).__name__} {value!r}\n".encode())
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
    from .codegen import runner
    from .freezing import FrozenGraph

    if entry.fold is not None:
        frozen = FrozenGraph(entry.fold, entry.main, list(entry.fold_inputs), list(entry.main_inputs), entry.n_folded)
        run_graph = frozen.bind(runner(entry.main, entry.direct, entry.runner_code))
    else:
        frozen, run_graph = None, runner(entry.main, entry.direct, entry.runner_code)
    run = inference_call(run_graph)
    run.frozen = frozen  # type: ignore[attr-defined]
    return run


def inference_call(run_graph: Callable[..., Any]) -> Callable[..., Any]:
    """``run_graph`` called as aot calls an inference graph whose calling convention it leaves as it is (no
    input mutation, no aliased output: :func:`calling_convention_problem`): without gradients."""

    def run(*args: Any) -> Any:
        with torch.no_grad():
            return run_graph(*args)

    return run


# ------------------------------------------------------------------------------------------------ the store


def _warn(message: str) -> None:
    warnings.warn(f"mindiesd cache: {message}", MindieSDCacheWarning, stacklevel=4)


class GraphCache:
    """Entries of one cache folder."""

    def __init__(self, root: str):
        self.root = Path(root).expanduser()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{_SUFFIX}"

    def load(self, key: str) -> Optional[CachedGraph]:
        """The entry stored under ``key``; None when there is none or it is unusable (with a warning)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            _warn(f"cannot read {path} ({exc}); compiling")
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
            write_atomic(path, data)
        except Exception as exc:
            _warn(f"cannot write {path} ({type(exc).__name__}: {exc}); the graph is compiled again next time")
            return None
        log.debug("cache store %s (%d bytes)", path, len(data))
        return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder renamed into place, so a reader sees
    a whole file or none (and two writers leave one whole file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
    root = _root(folder)
    if root is None or not root.is_dir():
        return []
    return sorted(root.glob(f"??/*{_SUFFIX}")) + artifact_files(folder)


#: The folder of the ahead-of-time artifacts (:mod:`mindiesd.compilation.aot`) in a cache folder, and their suffix.
ARTIFACT_FOLDER = "aot"
ARTIFACT_SUFFIX = ".aot"


def artifact_files(folder: Optional[str]) -> List[Path]:
    """The ahead-of-time artifact files of the cache ``folder``."""
    root = _root(folder)
    artifacts = root / ARTIFACT_FOLDER if root is not None else None
    return sorted(artifacts.glob(f"*{ARTIFACT_SUFFIX}")) if artifacts is not None and artifacts.is_dir() else []


def clear_cache(folder: Optional[str]) -> int:
    """Delete every entry and artifact (and leftover temporary file) of the cache ``folder``; returns how many were
    removed."""
    root = _root(folder)
    if root is None or not root.is_dir():
        return 0
    removed = 0
    leftovers = list(root.glob("??/.*.tmp")) + list(root.glob(f"{ARTIFACT_FOLDER}/.*.tmp"))
    for path in cache_entries(folder) + leftovers:
        with _ignored():
            path.unlink()
            removed += path.suffix in (_SUFFIX, ARTIFACT_SUFFIX)
    for folder_of_entries in [*root.glob("??"), root / ARTIFACT_FOLDER]:
        with _ignored():
            folder_of_entries.rmdir()
    return removed


def _root(folder: Optional[str]) -> Optional[Path]:
    return Path(folder).expanduser() if folder else None


def settings_for_key(settings: Dict[str, Any]) -> Dict[str, Any]:
    """The settings that can change the compiled graph."""
    return {k: v for k, v in settings.items() if k not in _RUN_TIME_SETTINGS}


#: Settings that change how the compiled graph is run or logged, not the graph.
_RUN_TIME_SETTINGS = ("cache_dir", "graph_log_url", "strict", "aclgraph_max_graphs", "safe_output_mode")


def describe(folder: Optional[str]) -> Tuple[Optional[Path], int, int]:
    """(folder, entries, bytes) of the cache ``folder`` (None: the cache is off)."""
    entries = cache_entries(folder)
    return _root(folder), len(entries), sum(p.stat().st_size for p in entries)
