"""Build machinery of the C++ CPU kernels: prebuilt modules, cache folder, capability flags, compile, load, self-check.

The kernels in ``_cpp/`` (one source per op, helpers shared in ``common.h``)
read their input once and write one contiguous output (ATen ``Vectorized``
arithmetic, ``at::parallel_for`` over rows; 16-bit values computed in float32
and rounded once; outputs larger than 3/4 of the last-level cache written
with non-temporal stores).  They come from one of two places, tried in this
order on the first call of a CPU kernel (or by
``mindiesd.ops.build_cpu_kernels()``), never at import:

1. Prebuilt: the package build (``setup.py``, where torch is importable in
   the build environment) compiles one extension module per instruction set,
   ``_cpu_kernels_<tag>`` beside this file, for the tags of :data:`TAGS`
   (``avx512bf16`` only where the compiler knows ``-mavx512bf16``), and
   writes :data:`MANIFEST`, which records the torch version, the Python ABI
   tag and a hash of the sources they were built from.  The module of this
   machine's capability is loaded (else the best lower one that was built),
   and only when the running torch, Python and sources are those of the
   manifest: torch's C++ ABI is not stable across versions.
2. JIT-built: otherwise ``torch.utils.cpp_extension.load`` (needs a C++
   compiler and ninja) builds the same sources for this machine's capability
   into a cache folder that later processes reuse:

* ``MINDIESD_CPP_CACHE``: cache folder (default ``~/.cache/mindiesd/cpp``).
* ``MINDIESD_CPP_KERNELS=0``: keep the aten composition kernels of ``cpu.py``.

Both target an ATen CPU capability (``torch.backends.cpu.get_cpu_capability()``:
AVX512, AVX2 or DEFAULT, plus AVX512-BF16 where the CPU has it) with the ISA
flags ATen uses for that capability (:func:`capability_flags`).  The
capability, the torch and Python versions, the flags and a hash of every
source and header name the cached JIT build, so a build is only reused where
it can run and only for the sources it was built from.  When no compiler or
ninja is found or the build fails, one warning names the cause and
:func:`extension` returns None.  The op wrappers that fall back to the
composition kernels live in ``cpp.py``.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

__all__ = ["build_cpu_kernels", "capability_flags", "cpu_kernel_implementation", "enabled", "extension"]

CACHE_ENV = "MINDIESD_CPP_CACHE"
ENABLE_ENV = "MINDIESD_CPP_KERNELS"
SOURCE_DIR = Path(__file__).parent.parent / "_cpp"
# The compiled sources (one per op, the build and streaming settings, the bindings) and the headers they
# include: every file of _cpp/; build_name() hashes all of them.
SOURCES = tuple(sorted(path.name for path in SOURCE_DIR.glob("*.cpp")))
HEADERS = tuple(sorted(path.name for path in SOURCE_DIR.glob("*.h")))
#: Op name -> (declaration, sample arguments from self_check_tensors(), whether the entry point takes the
#: resolved out_dtype last): the self-check of each C++ kernel, filled by ``cpp.native``.
SELF_CHECKS: dict = {}
# Wall time of the first build on a 2-core machine, for the progress line.
ESTIMATED_BUILD_SECONDS = 180

#: The instruction sets the kernels are built for (cache and module tag -> ISA flags, following ATen's own
#: per-capability kernel flags), best first: a machine runs the first one it supports.
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                 "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
_TAG_FLAGS: dict[str, list[str]] = {
    # native float32 -> bfloat16 rounding (vcvtne2ps2bf16)
    "avx512bf16": _AVX512_FLAGS + ["-mavx512bf16"],
    "avx512": _AVX512_FLAGS,
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "default": ["-DCPU_CAPABILITY=DEFAULT"],
}
TAGS = tuple(_TAG_FLAGS)
_COMMON_FLAGS = ["-O3", "-DNDEBUG", "-fopenmp"]
LINK_FLAGS = ["-fopenmp"]
_READY_MARKER = "ready"

#: Folder of the prebuilt modules and their manifest (the package build puts them beside this file).
PREBUILT_DIR = Path(__file__).parent
#: Name of a prebuilt module: this prefix and the tag (``_cpu_kernels_avx2``).
PREBUILT_PREFIX = "_cpu_kernels_"
#: What the prebuilt modules were built against and from (JSON, written by the package build).
MANIFEST = "_cpu_kernels.json"

_lock = threading.Lock()
_extension: ModuleType | None = None
_resolved = False
_failure: str | None = None
#: Why installed prebuilt kernels were not used, or None (none installed, or they are in use).
_prebuilt_refused: str | None = None


def cache_root() -> Path:
    """Folder that holds the cached builds (``$MINDIESD_CPP_CACHE`` or ~/.cache/mindiesd/cpp)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "mindiesd" / "cpp"


def enabled() -> bool:
    """False when ``MINDIESD_CPP_KERNELS`` asks for the composition kernels."""
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def capability_flags(tag: str) -> list[str]:
    """Compiler flags (optimisation and ISA) of a build for ``tag`` (one of :data:`TAGS`)."""
    return _COMMON_FLAGS + _TAG_FLAGS[tag]


def _capability_tag() -> str:
    """The tag of :data:`TAGS` for ATen's CPU capability on this machine."""
    try:
        name = torch.backends.cpu.get_cpu_capability().upper()
    except Exception:  # noqa: BLE001  (older torch or exotic platforms)
        name = "DEFAULT"
    machine = sysconfig.get_platform()
    if "x86_64" not in machine and "amd64" not in machine.lower():
        return "default"
    if name.startswith("AVX512"):
        return "avx512bf16" if _has_avx512_bf16() else "avx512"
    if name.startswith("AVX2"):
        return "avx2"
    return "default"


def _capability() -> tuple[str, list[str]]:
    """(cache tag, ISA flags) for ATen's CPU capability on this machine."""
    tag = _capability_tag()
    return tag, _TAG_FLAGS[tag]


def _has_avx512_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported())
    except Exception:  # noqa: BLE001  (absent in some torch versions)
        return False


def source_files() -> list[Path]:
    """Every file a build reads: SOURCES, HEADERS and any other ``.cpp``/``.h`` in ``_cpp/``, sorted."""
    listed = {SOURCE_DIR / file for file in SOURCES + HEADERS}
    return sorted(listed | set(SOURCE_DIR.glob("*.cpp")) | set(SOURCE_DIR.glob("*.h")))


def _hash_sources(digest):
    """``digest`` updated with the name and content of every file of :func:`source_files`."""
    for path in source_files():
        content = path.read_bytes()
        digest.update(f"{path.name}\0{len(content)}\0".encode() + content)
    return digest


def sources_digest() -> str:
    """SHA-256 of the name and content of every file of :func:`source_files` (the prebuilt manifest's)."""
    return _hash_sources(hashlib.sha256()).hexdigest()


def build_name() -> tuple[str, list[str]]:
    """(extension name, compiler flags); the name is the cache key of the build.

    It hashes the name and content of every file of :func:`source_files`, so that any edit of a source or
    header builds anew.
    """
    tag = _capability_tag()
    flags = capability_flags(tag)
    digest = _hash_sources(hashlib.sha256())
    for part in (torch.__version__, str(torch.version.git_version), sys.implementation.cache_tag,
                 sysconfig.get_config_var("EXT_SUFFIX") or "", " ".join(flags)):
        digest.update(b"\0" + part.encode())
    return f"mindiesd_cpu_kernels_{tag}_{digest.hexdigest()[:16]}", flags


def _import_extension(name: str, path: Path) -> ModuleType:
    """Import the extension module ``name`` from the file ``path`` (raises ImportError); the module already
    imported from that file is returned as it is."""
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")) == Path(path):
        return loaded
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module


def untrusted_build_folder(directory: Path) -> str | None:
    """Why the cached build ``directory`` (under :func:`cache_root`) must not be loaded from or built into, or None.

    Importing a built module runs its code, so a module someone else could have written is never imported: the
    cache root, the build folder and every file in it must be owned by this user (or root; another owner where
    ``$MINDIESD_CACHE_TRUST_FOREIGN_OWNER`` trusts it) and writable by nobody else, with no symbolic link below
    the root: the check the graph cache makes before it unpickles an entry (``files/trust.py``)."""
    from ...files.trust import trust_foreign_owner_from_env, untrusted_reason  # here: setup.py loads this file alone

    root = cache_root()
    trust = trust_foreign_owner_from_env()
    if not root.exists():
        return None  # made by this user on the first build
    paths = [root]
    if directory.exists() or directory.is_symlink():
        paths.append(directory)
        if directory.is_dir() and not directory.is_symlink():
            paths.extend(sorted(directory.iterdir()))
    for path in paths:
        reason = untrusted_reason(path, root, trust)
        if reason is not None:
            return reason
    return None


def _import_built(name: str, directory: Path) -> ModuleType | None:
    """Import an already-built extension from ``directory``, or None."""
    if name in sys.modules:
        return sys.modules[name]
    if not (directory / _READY_MARKER).exists():
        return None
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for candidate in (directory / f"{name}.so", directory / f"{name}{suffix}"):
        if candidate.exists():
            return _import_extension(name, candidate)
    return None


def build_facts() -> dict[str, str]:
    """What prebuilt modules must have been built against to be loaded: this torch (version and commit), this
    Python ABI and these C++ sources (:func:`sources_digest`)."""
    return {
        "torch": torch.__version__,
        "torch_git": str(torch.version.git_version),
        "python": sys.implementation.cache_tag,
        "sources": sources_digest(),
    }


def write_manifest(directory: Path, modules: dict[str, str], commands: dict[str, list[str]] | None = None) -> Path:
    """Write :data:`MANIFEST` into ``directory``: the prebuilt modules there (tag -> file name),
    :func:`build_facts` of the build and the compiler and flags of each module (``commands``, tag -> list; what
    a later package build compares before it reuses a module).  Called by the package build."""
    path = Path(directory) / MANIFEST
    content = {**build_facts(), "modules": modules, "commands": dict(commands or {})}
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return path


def reusable_module(directory: Path, tag: str, command: list[str]) -> Path | None:
    """The module for ``tag`` that an earlier package build left in ``directory`` (an editable install's source
    tree), where its manifest says it was built from these sources, against this torch and Python, with this
    compiler ``command``; else None."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
        name = manifest["modules"][tag]
        same = all(manifest.get(key) == value for key, value in build_facts().items())
        same = same and manifest.get("commands", {}).get(tag) == list(command)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    path = Path(directory) / str(name)
    return path if same and path.is_file() else None


def prebuilt_module_name(tag: str) -> str:
    """Full module name of the prebuilt module for ``tag`` (it lives beside this file)."""
    package = __name__.rpartition(".")[0]
    return f"{package}.{PREBUILT_PREFIX}{tag}" if package else f"{PREBUILT_PREFIX}{tag}"


def _load_prebuilt() -> tuple[ModuleType | None, str | None]:
    """(the prebuilt module for this machine, None), else (None, why it is not used); (None, None) where no
    prebuilt kernels are installed (no manifest: a source checkout, or a build without torch)."""
    path = PREBUILT_DIR / MANIFEST
    if not path.exists():
        return None, None
    try:
        manifest = json.loads(path.read_text())
        modules = dict(manifest["modules"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"unreadable {path}: {error}"
    facts = build_facts()
    if (manifest.get("torch"), manifest.get("torch_git")) != (facts["torch"], facts["torch_git"]):
        return None, f"built against torch {manifest.get('torch')}, this is torch {facts['torch']}"
    if manifest.get("python") != facts["python"]:
        return None, f"built for {manifest.get('python')}, this is {facts['python']}"
    if manifest.get("sources") != facts["sources"]:
        return None, "the C++ sources changed since they were built"
    tag = _capability_tag()
    usable = [candidate for candidate in TAGS[TAGS.index(tag):] if modules.get(candidate)]
    if not usable:
        return None, f"none built for {tag} or a capability below it (built: {', '.join(modules) or 'none'})"
    file = PREBUILT_DIR / modules[usable[0]]
    try:
        return _import_extension(prebuilt_module_name(usable[0]), file), None
    except Exception as error:  # noqa: BLE001  (missing or damaged file: the JIT build takes over)
        return None, f"{file.name} does not load: {_summarize(error)}"


def _origin(module: ModuleType) -> str:
    """'prebuilt' for a module the package build made, 'JIT-built' for one built at first use."""
    return "prebuilt" if module.__name__.rpartition(".")[2].startswith(PREBUILT_PREFIX) else "JIT-built"


def _missing_tool() -> str | None:
    """The reason a build cannot start (no compiler, no ninja), or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler found (looked for {compiler!r}; set CXX to choose one)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


#: A build folder's lock whose folder has not changed for this long is left by a build that was killed (a live
#: build writes an object file every minute or two): torch's build waits for a lock for ever, so it is removed.
STALE_LOCK_SECONDS = 600


def _clear_stale_lock(directory: Path) -> None:
    """Remove the lock of ``directory`` where nothing in it changed for STALE_LOCK_SECONDS (saying so)."""
    lock = directory / "lock"
    try:
        newest = max(path.stat().st_mtime for path in directory.iterdir())
    except (OSError, ValueError):
        return
    if lock.exists() and time.time() - newest > STALE_LOCK_SECONDS:
        print(f"mindiesd: removing {lock}, left by a build that did not finish (nothing in that folder changed "
              f"for {STALE_LOCK_SECONDS // 60} min)", file=sys.stderr, flush=True)
        lock.unlink(missing_ok=True)


def _compile(name: str, flags: list[str], directory: Path) -> ModuleType:
    """Build the extension into ``directory`` and import it (raises on failure)."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    _clear_stale_lock(directory)
    module = cpp_extension.load(
        name=name,
        sources=[str(SOURCE_DIR / file) for file in SOURCES],
        extra_cflags=flags,
        extra_ldflags=LINK_FLAGS,
        build_directory=str(directory),
        verbose=False,
    )
    marker = directory / f"{_READY_MARKER}.{os.getpid()}"
    marker.write_text(f"{torch.__version__}\n")
    marker.replace(directory / _READY_MARKER)
    return module


def _last_level_cache_bytes() -> int | None:
    """Size of the last-level cache one core sees (Linux sysfs), or None."""
    best_level, best_size = 0, None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
        if level > best_level:
            best_level, best_size = level, size
    return best_size


def _configure(module: ModuleType) -> None:
    """Stream (non-temporal stores) outputs of at least 3/4 of the last-level cache."""
    cache = _last_level_cache_bytes()
    if cache:
        module.set_streaming_threshold(cache * 3 // 4)


def self_check_tensors() -> SimpleNamespace:
    """The small sample tensors the self-check's arguments are made of."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 40, generator=generator)
    w = torch.randn(40, generator=generator)
    scale, shift = torch.randn(3, 1, 40, generator=generator), torch.randn(40, generator=generator)
    cos, sin = torch.randn(2, 20, generator=generator), torch.randn(2, 20, generator=generator)
    return SimpleNamespace(x=x, w=w, scale=scale, shift=shift, cos=cos, sin=sin)


def _self_check(module: ModuleType) -> None:
    """Compare each kernel with the reference on a small input (raises on mismatch)."""
    tensors = self_check_tensors()
    for name, (op, sample, takes_out_dtype) in SELF_CHECKS.items():
        args = sample(tensors)
        actual = getattr(module, name)(*args, *((torch.float32,) if takes_out_dtype else ()))
        expected = op.reference(*args)
        if actual is None or not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4):
            raise RuntimeError(
                f"self-check of {name} failed: the built kernel disagrees with the reference"
            )


class _NotBuilt(Exception):
    """No cached build, and the caller asked not to compile one."""


def _load(build: bool = True) -> ModuleType | None:
    """Import the prebuilt module, else the cached JIT build, else build it (``build=False``: raise
    :class:`_NotBuilt` instead of compiling); on failure warn once and return None."""
    global _failure, _prebuilt_refused
    if not enabled():
        _failure = f"disabled by {ENABLE_ENV}={os.environ.get(ENABLE_ENV)}"
        return None
    module, _prebuilt_refused = _load_prebuilt()
    if module is not None:
        try:
            _configure(module)
            _self_check(module)
            return module
        except Exception as error:  # noqa: BLE001  (the JIT build takes over)
            _prebuilt_refused = _summarize(error)
    try:
        name, flags = build_name()
        directory = cache_root() / name
        untrusted = untrusted_build_folder(directory)
        if untrusted is not None:
            raise RuntimeError(f"the cached builds' folder is not trusted: {untrusted}; nothing is loaded from it "
                               f"or built into it (set {CACHE_ENV} to a folder of your own)")
        module = None
        try:
            module = _import_built(name, directory)
        except Exception:  # noqa: BLE001  (a damaged cache entry is rebuilt)
            module = None
        if module is None:
            missing = _missing_tool()
            if missing is not None:
                raise RuntimeError(missing)
            if not build:
                raise _NotBuilt()
            if _prebuilt_refused is not None:
                print(
                    f"mindiesd: not using the prebuilt CPU kernels ({_prebuilt_refused})",
                    file=sys.stderr,
                    flush=True,
                )
            print(
                f"mindiesd: building mindiesd CPU kernels (one-time, ~{ESTIMATED_BUILD_SECONDS} s) "
                f"into {directory}",
                file=sys.stderr,
                flush=True,
            )
            start = time.perf_counter()
            module = _compile(name, flags, directory)
            print(
                f"mindiesd: CPU kernels built in {time.perf_counter() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        _configure(module)
        _self_check(module)
        return module
    except _NotBuilt:
        raise
    except Exception as error:  # noqa: BLE001  (never fail the op: fall back)
        _failure = _summarize(error)
        if _prebuilt_refused is not None:
            _failure += f"; prebuilt kernels not used: {_prebuilt_refused}"
        warnings.warn(
            f"mindiesd: the C++ CPU kernels are unavailable ({_failure}); "
            "using the aten composition kernels instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _summarize(error: BaseException) -> str:
    """A short cause: the first compiler error line when there is one."""
    text = str(error).strip() or type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "error:" in line or "fatal error" in line:
            return f"build failed: {line}"
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def extension(build: bool = True) -> ModuleType | None:
    """The loaded C++ kernel module (building it on first use), or None.

    With ``build=False`` nothing is compiled: a cached build is loaded, and where there is none the call returns
    None and decides nothing (a later call still builds).
    """
    global _extension, _resolved
    if _resolved:
        return _extension
    with _lock:
        if not _resolved:
            try:
                _extension = _load(build)
            except _NotBuilt:
                return None
            _resolved = True
    return _extension


def build_cpu_kernels() -> bool:
    """Build (or load the cached build of) the C++ CPU kernels now.

    Returns True when they are active, False when the composition kernels
    stay in place (the warning says why).
    """
    return extension() is not None


def cpu_kernel_implementation(build: bool = True) -> str:
    """Which CPU kernels run: 'C++ prebuilt (<capability>, <n> float lanes)' (the package build's),
    'C++ JIT-built (<capability>, <n> float lanes)' (built at first use) or 'composition (<reason>)'.

    It loads the C++ kernels, building them first where neither prebuilt kernels nor a cached build exist
    (one-time, a few minutes). With ``build=False`` it never compiles: then it answers 'not built yet (...)'. Where
    installed prebuilt kernels are not used, the answer ends with why.
    """
    module = extension(build)
    refused = f"; prebuilt kernels not used: {_prebuilt_refused}" if _prebuilt_refused else ""
    if module is not None:
        return f"C++ {_origin(module)} ({module.capability()}, {module.vector_lanes} float lanes){refused}"
    if not _resolved:
        return f"not built yet (the C++ kernels for {_capability()[0]} build on the first CPU kernel call{refused})"
    return f"composition ({_failure or 'C++ kernels unavailable'})"


def _reset() -> None:
    """Forget the loaded module so the next call loads again (for tests)."""
    global _extension, _resolved, _failure, _prebuilt_refused
    with _lock:
        _extension, _resolved, _failure, _prebuilt_refused = None, False, None, None
