"""Ahead-of-time artifacts: a module's compiled forward stored once, loaded by later processes without Dynamo.

    from mindiesd.compilation import MindieSDBackend, aot_compile
    pipe.transformer = aot_compile(pipe.transformer, backend=MindieSDBackend())

:func:`aot_compile` gives the module a forward that, on the first call with a new input signature (shapes,
strides, dtypes, devices of the tensors; values of the other arguments; grad mode), loads the matching artifact
from ``<cache_dir>/aot/`` and runs it: no Dynamo trace, no backend. Where there is none, it traces the forward
once with Dynamo (``fullgraph``), runs the backend on the graph, and stores the result: Dynamo's guards on the
inputs, its bytecode, and the fused aten graph with its fold graph (what the persistent graph cache stores).
Weights are not in the artifact: they are inputs of the graph, read from the module at each call, so weights
changed in place (a LoRA hot-swap, ``load_state_dict``) are seen and the folded constants are refolded.

An artifact is found by a key over the versions (Python, torch, diffusers, mindiesd and its sources), the
module's class, config, structure (submodule types, parameter shapes and dtypes, attention processors), the source
files of those classes, and the backend's settings: a changed source or version selects another artifact, and
the module is compiled again. With ``dynamic=True`` the input signature is the tensors' ranks, not their sizes: a
process that starts at any size loads the symbolic graph another process stored (a model whose code specializes a
size gets one artifact per such size, up to :data:`SLOTS` per signature, told apart by their guards). A truncated,
corrupt or foreign artifact is ignored with a
:class:`~mindiesd.compilation.storage.cache.MindieSDCacheWarning` and compiled again. A forward Dynamo cannot trace as
one graph (graph breaks), or whose graph cannot be stored, runs through ``torch.compile`` with the same backend,
with one warning that says why. Without a cache folder (``cache_dir=None``) the artifacts live in memory only.
Device-graph capture (``aclgraph_*``) wraps the loaded graph, so captures are made afresh in each process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import pickle
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .storage import cache as graph_cache
from .backend import MindieSDBackend, folded_reader
from .config import CompilationConfig
from .context import is_weight
from .runtime.device_graph import wrap_for_capture

log = logging.getLogger("mindiesd.compilation")

__all__ = ["aot_compile", "aot_forwards", "AotForward", "ArtifactGraph"]

FOLDER, SUFFIX = graph_cache.ARTIFACT_FOLDER, graph_cache.ARTIFACT_SUFFIX
#: Artifacts kept per module and input signature (with ``dynamic=True`` a signature is the tensors' ranks: sizes
#: that the model's own code specializes on get artifacts of their own, told apart by their guards).
SLOTS = 8

#: functorch settings torch's aot_compile turns on around the backend for Inductor's bundled cache; the
#: backend's own aot_module_simplified with a plain compiler needs them off.
_FUNCTORCH_DEFAULTS = {
    "bundled_autograd_cache": False, "force_autograd_cache": False, "strict_autograd_cache": False,
    "bypass_autograd_cache_key": False, "force_non_lazy_backward_lowering": False,
}


class _NotStorable(Exception):
    """The forward compiles, but not into an artifact (the reason is the message)."""


# ------------------------------------------------------------------------------------------ the stored graph

try:
    from torch._dynamo.aot_compile_types import SerializableCallable as _Serializable
except ImportError:  # a torch without ahead-of-time compilation: aot_compile falls back to torch.compile
    _Serializable = object  # type: ignore[assignment,misc]


class ArtifactGraph(_Serializable):  # type: ignore[misc,valid-type]
    """The backend's result for one Dynamo graph inside an artifact: the fused graph (and fold graph), the
    settings, the device and which inputs are weights, so that a loaded graph is run (and captured) as a compiled
    one is."""

    def __init__(self, entry: graph_cache.CachedGraph, settings: Dict[str, Any], device: Optional[str],
                 weights: Tuple[int, ...]):
        entry.check()
        self.entry, self.settings, self.device, self.weights = entry, settings, device, tuple(weights)
        run = graph_cache.runnable(entry)
        frozen = run.frozen
        self.run = wrap_for_capture(run, CompilationConfig(**settings), torch.device(device) if device else None,
                                    self.weights, label="artifact graph",
                                    reads=folded_reader(frozen) if frozen is not None else None)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "ArtifactGraph") -> bytes:
        return pickle.dumps((fn.entry, fn.settings, fn.device, fn.weights), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "ArtifactGraph":
        entry, settings, device, weights = pickle.loads(data)
        if not isinstance(entry, graph_cache.CachedGraph):
            raise ValueError(f"the artifact holds a {type(entry).__name__}, not a graph")
        return cls(entry, settings, device, weights)

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)


class _ArtifactBackend:
    """The Dynamo backend of an ahead-of-time compile: ``backend``'s fusion, returned as an :class:`ArtifactGraph`."""

    compiler_name = "mindiesd"

    def __init__(self, backend: MindieSDBackend):
        self.backend = backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List[Any]) -> ArtifactGraph:
        with torch._functorch.config.patch(_FUNCTORCH_DEFAULTS):
            try:
                entry = self.backend.compile_for_artifact(gm, example_inputs)
            except ValueError as exc:
                raise _NotStorable(str(exc)) from exc
        device = next((str(t.device) for t in example_inputs if isinstance(t, torch.Tensor)), None)
        weights = tuple(i for i, t in enumerate(example_inputs) if is_weight(t))
        return ArtifactGraph(entry, self.backend.config.to_dict(), device, weights)


def _keep_guard(entry: Any) -> bool:
    """Whether Dynamo's guard ``entry`` goes into the artifact: the guards on the inputs (shapes, strides, dtypes,
    devices, values) do; identity guards, globals and guards on a function's defaults cannot be saved and are
    left out (the artifact's key covers the sources and the module's structure instead)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return not (entry.is_global or entry.guard_type in unsaveable
                or any(t in unsaveable for t in entry.derived_guard_types) or "__defaults__" in entry.name)


def _guard_filter(entries: List[Any]) -> List[bool]:
    return [_keep_guard(entry) for entry in entries]


# -------------------------------------------------------------------------------------------------- the key

_SOURCE_DIGESTS: Dict[str, str] = {}


def _file_digest(path: Optional[str]) -> str:
    if not path:
        return "-"
    if path not in _SOURCE_DIGESTS:
        try:
            _SOURCE_DIGESTS[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            _SOURCE_DIGESTS[path] = "-"
    return _SOURCE_DIGESTS[path]


def _classes(module: torch.nn.Module) -> Iterator[type]:
    for sub in module.modules():
        yield type(sub)
        processor = getattr(sub, "processor", None)
        if processor is not None:
            yield type(processor)


def model_key(module: torch.nn.Module, backend: MindieSDBackend, dynamic: Optional[bool]) -> Dict[str, Any]:
    """What an artifact of ``module`` depends on besides its inputs (the artifact's file name hashes it)."""
    config = getattr(module, "config", None)
    classes = sorted({f"{c.__module__}.{c.__qualname__}": c for c in _classes(module)}.items())
    sources = {name: _file_digest(_source_file(cls)) for name, cls in classes}
    structure = [(name, type(sub).__qualname__, type(getattr(sub, "processor", None)).__qualname__)
                 for name, sub in module.named_modules()]
    tensors = [(name, tuple(t.shape), str(t.dtype), str(t.device), isinstance(t, torch.nn.Parameter))
               for name, t in (*module.named_parameters(), *module.named_buffers())]
    return {
        "versions": graph_cache._versions(), "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "config": _config_text(config),
        "sources": sources, "structure": structure, "tensors": tensors,
        "settings": graph_cache.settings_for_key(backend.config.to_dict()), "force": sorted(backend.force_fast),
        "dynamic": dynamic, "training": module.training, "rank": _rank(),
    }


def _rank() -> Tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one: each rank has its artifacts."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _config_text(config: Any) -> str:
    """A diffusers model's config as text, without its bookkeeping keys (``_use_default_values`` lists a set, in
    an order that differs between processes)."""
    if not isinstance(config, dict):
        return "-"
    return json.dumps({k: v for k, v in config.items() if not str(k).startswith("_")}, sort_keys=True, default=repr)


@functools.lru_cache(maxsize=None)
def _source_file(cls: type) -> Optional[str]:
    """The file defining ``cls`` (looked up once per class: a regional compile keys every block)."""
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None


def _signature(value: Any, dynamic: Optional[bool]) -> Any:
    """What selects an artifact among those of one module: the tensors' shapes (ranks with ``dynamic=True``),
    strides, dtypes and devices, the other arguments' values."""
    if isinstance(value, torch.Tensor):
        shape = value.dim() if dynamic else (tuple(value.shape), value.stride())
        return ("tensor", shape, str(value.dtype), str(value.device), value.requires_grad)
    if isinstance(value, dict):
        return ("dict", tuple((k, _signature(v, dynamic)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v, dynamic) for v in value))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(value).__name__, repr(value))
    return (type(value).__qualname__,)


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------ the forward


def _warn(message: str) -> None:
    warnings.warn(f"mindiesd aot: {message}", graph_cache.MindieSDCacheWarning, stacklevel=4)


class AotForward:
    """The forward :func:`aot_compile` gives a module: per input signature, the artifact loaded or compiled once.

    :attr:`outcomes` maps each artifact key (a hash of the module's key and the input signature) to how it runs: ``loaded`` (an artifact from the cache folder),
    ``stored`` (compiled and written), ``compiled`` (compiled, kept in memory: no cache folder or not writable),
    ``shared`` (the artifact another module of the same :func:`aot_compile` call uses: a repeated block) or
    ``torch.compile: <why>`` (not an artifact). :attr:`seconds` holds the time each took to become runnable.
    """

    def __init__(self, module: torch.nn.Module, backend: MindieSDBackend, dynamic: Optional[bool],
                 shared: Optional[Dict[str, Any]] = None):
        self.module, self.backend, self.dynamic = module, backend, dynamic
        #: Artifacts by key, shared by the forwards of one aot_compile call (the blocks of a regional compile).
        self.shared: Dict[str, Any] = shared if shared is not None else {}
        self.function = type(module).forward
        #: Per signature, what runs it: (artifact, its callable); a new artifact is added where the guards of
        #: those there refuse the inputs (``dynamic=True`` keys by rank only; a module changed in structure).
        self._runs: Dict[Any, List[Tuple[Any, Callable[..., Any]]]] = {}
        self._artifacts: Dict[str, Any] = {}
        self.outcomes: Dict[str, str] = {}
        self.seconds: Dict[str, float] = {}

    def graphs(self) -> List[torch.fx.GraphModule]:
        """The fused graphs of the artifacts in use (loaded or compiled), one per signature, to inspect."""
        return [artifact._artifacts.compiled_fn.entry.main for artifact in self._artifacts.values()]

    def matches(self) -> Dict[str, int]:
        """Rewrites per family in the artifacts in use, as their compile recorded them (loaded ones too)."""
        total: Dict[str, int] = {}
        for artifact in self._artifacts.values():
            for family, count in artifact._artifacts.compiled_fn.entry.matches.items():
                total[family] = total.get(family, 0) + count
        return total

    def kernel_choices(self) -> List[str]:
        """What each measured fused op site of the artifacts in use runs, with the candidates' times, as their
        compile measured it (``kernel_choice``; loaded artifacts are not measured again)."""
        return [line for artifact in self._artifacts.values()
                for line in getattr(artifact._artifacts.compiled_fn.entry, "kernel_choices", ())]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        signature = (_signature((args, kwargs), self.dynamic), torch.is_grad_enabled())
        candidates = self._runs.setdefault(signature, [])
        for artifact, run in candidates:
            if artifact is None:  # torch.compile: its own guards
                return run(*args, **kwargs)
            if artifact.guard_check(self.module, *args, **kwargs):
                return artifact.fn(self.module, *args, **kwargs)
        start = time.perf_counter()
        base = _digest(model_key(self.module, self.backend, self.dynamic),
                       _signature((args, kwargs), self.dynamic), torch.is_grad_enabled())
        run, key, outcome, artifact = self._prepare(base, args, kwargs)
        self.outcomes[key], self.seconds[key] = outcome, time.perf_counter() - start
        if artifact is not None:
            self._artifacts[key] = artifact
        candidates.append((artifact, run))
        return run(*args, **kwargs)

    def _closure(self) -> Dict[str, Any]:
        """The forward's closure cells (a decorated forward holds the undecorated one): passed by reference, as
        they are the same objects in the process that loads the artifact."""
        return {f"cell{i}": cell.cell_contents for i, cell in enumerate(self.function.__closure__ or ())}

    def _prepare(self, base: str, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Tuple[Callable[..., Any], str, str, Any]:
        """How these inputs run: the callable, the artifact's key, the outcome's word and the artifact (None: not
        one). The artifacts of one signature are ``<base>-0``, ``<base>-1``, …: the first whose guards accept the
        inputs runs them; where none does, a new one is compiled into the first free place (the last place is
        replaced once all :data:`SLOTS` are taken)."""
        folder = graph_cache.CacheFolder.of(self.backend.config)
        free = None
        for slot in range(SLOTS):
            key = f"{base}-{slot}"
            known = self.shared.get(key)
            if known is not None:
                if known.guard_check(self.module, *args, **kwargs):
                    return self._bind(known), key, "shared", known
                continue
            path = folder.root / FOLDER / f"{key}{SUFFIX}" if folder is not None else None
            if path is None or not path.exists():
                free = key if free is None else free
                continue
            loaded, refused = self._load(folder, path, key, args, kwargs)
            if loaded is not None:
                self.shared[key] = loaded
                return self._bind(loaded), key, "loaded", loaded
            if not refused:  # untrusted or unusable: compiled in its place
                free = key if free is None else free
                break
        key = free if free is not None else f"{base}-{SLOTS - 1}"
        try:
            compiled = self._compile(args, kwargs)
        except _NotStorable as exc:
            return self._torch_compile(key, f"its graph cannot be stored ({exc})")
        except Exception as exc:  # graph breaks, or what Dynamo's ahead-of-time path does not support
            return self._torch_compile(key, f"{type(exc).__name__}: {_first_line(exc)}")
        outcome = "compiled"
        self.shared[key] = compiled
        if folder is not None:
            path = folder.root / FOLDER / f"{key}{SUFFIX}"
            outcome = "stored" if self._store(folder, compiled, path, key) else "compiled"
        return self._bind(compiled), key, outcome, compiled

    def _bind(self, compiled: Any) -> Callable[..., Any]:
        module = self.module

        def run(*args: Any, **kwargs: Any) -> Any:
            return compiled(module, *args, **kwargs)

        return run

    def _compile(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if _Serializable is object:
            raise _NotStorable(f"torch {torch.__version__} has no ahead-of-time compilation (torch 2.11 and later)")
        # specialize_float: Python floats stay constants (the signature holds their values); tensorifying them
        # restarts Dynamo's analysis, which its ahead-of-time path does not do. torch.compile itself runs inside
        # the patch: before torch 2.13 it gives the compiled function its aot_compile only where it is enabled.
        with torch._dynamo.config.patch(enable_aot_compile=True, specialize_float=True), self._plain_module():
            compiled = torch.compile(self.function, fullgraph=True, dynamic=self.dynamic,
                                     backend=_ArtifactBackend(self.backend), options={"guard_filter_fn": _guard_filter})
            return compiled.aot_compile(((self.module, *args), kwargs))

    @contextlib.contextmanager
    def _plain_module(self) -> Iterator[None]:
        """The module without this forward while Dynamo traces it and saves its guards (which pickle what they
        read of the module: not the backend)."""
        forward = self.module.__dict__.pop("forward", None)
        try:
            yield
        finally:
            if forward is not None:
                self.module.__dict__["forward"] = forward

    def _store(self, folder: graph_cache.CacheFolder, compiled: Any, path: Path, key: str) -> bool:
        try:
            data = type(compiled).serialize(compiled, self._closure()).serialized_data
            if not folder.write(path, graph_cache.frame(data, key)):
                return False
        except Exception as exc:
            _warn(f"cannot store the artifact of {type(self.module).__name__} ({type(exc).__name__}: "
                  f"{_first_line(exc)}); it is compiled again in the next process")
            return False
        log.info("aot: stored %s (%d bytes)", path, path.stat().st_size)
        return True

    def _load(self, folder: graph_cache.CacheFolder, path: Path, key: str, args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Tuple[Optional[Any], bool]:
        """(the artifact at ``path`` if it runs these inputs, whether it is a usable one whose guards refuse them:
        another artifact of the signature may take them). An untrusted or unusable one is neither (a warning
        says why): its place is where the compiled one goes (or is not written, where that place is refused)."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        try:
            framed = folder.read(path)
            if framed is None:
                return None, False
            data = graph_cache.unframe(framed, key)
            loaded = AOTCompiledFunction.deserialize(data, f_globals=self.function.__globals__,
                                                     external_closure_data=self._closure())
            accepted = loaded.guard_check(self.module, *args, **kwargs)
        except Exception as exc:
            _warn(f"ignoring the unusable artifact {path} ({type(exc).__name__}: {_first_line(exc)}); compiling")
            return None, False
        if not accepted:  # another artifact of this signature (sizes its guards tell apart), or a stale one
            log.debug("aot: the artifact %s does not accept these inputs", path)
            return None, True
        log.info("aot: loaded %s", path)
        return loaded, False

    def _torch_compile(self, key: str, why: str) -> Tuple[Callable[..., Any], str, str, None]:
        _warn(f"{type(self.module).__name__} is compiled with torch.compile, without an artifact: {why}")
        compiled = torch.compile(self.function, backend=self.backend, dynamic=self.dynamic)
        return self._bind(compiled), key, f"torch.compile: {why}", None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def aot_forwards(module: torch.nn.Module) -> List[AotForward]:
    """The forwards :func:`aot_compile` gave ``module`` and its submodules (one, or one per repeated block)."""
    return [sub.__dict__["forward"] for sub in module.modules() if isinstance(sub.__dict__.get("forward"), AotForward)]


def aot_compile(module: torch.nn.Module, backend: Optional[MindieSDBackend] = None, *,
                dynamic: Optional[bool] = None, regional: bool = False) -> torch.nn.Module:
    """Give ``module`` a forward compiled ahead of time by ``backend`` (default ``MindieSDBackend()``), with its
    artifacts in ``backend.config.cache_dir``; returns ``module`` itself, so pipelines and hooks see the same
    object. ``del module.forward`` restores the uncompiled forward.

    ``regional=True`` compiles the model's repeated blocks instead (the classes its ``_repeated_blocks`` names, as
    diffusers' ``compile_repeated_blocks``): one artifact per block class and input signature, shared by every
    block of the class, so a warm start does not grow with the depth.

    Use it in place of ``torch.compile(module, backend=...)`` where processes start often: the first process pays
    the trace and stores the artifact, later ones load it in a fraction of a second.
    """
    if backend is None:
        backend = MindieSDBackend()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"aot_compile takes a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(backend, MindieSDBackend):
        raise TypeError(f"backend must be a MindieSDBackend, got {type(backend).__name__}")
    targets = [module]
    if regional:
        names = set(getattr(module, "_repeated_blocks", None) or ())
        targets = [sub for sub in module.modules() if type(sub).__name__ in names]
        if not targets:
            raise ValueError(f"{type(module).__name__} declares no repeated blocks (_repeated_blocks = "
                             f"{sorted(names)}); set _repeated_blocks to the block class names to compile them")
    for target in targets:
        if isinstance(target.__dict__.get("forward"), AotForward):
            raise ValueError(f"{type(target).__name__} is already compiled ahead of time (del .forward first)")
    shared: Dict[str, Any] = {}
    for target in targets:
        if "forward" in target.__dict__:  # hooks that replace the forward (diffusers' context parallelism, ...)
            _warn(f"{type(target).__name__} has a forward of its own (a hook replaced it): an artifact of the "
                  "class's forward would bypass it, so it is compiled with torch.compile in place")
            target.compile(backend=backend, dynamic=dynamic)
            continue
        target.forward = AotForward(target, backend, dynamic, shared)
    return module
