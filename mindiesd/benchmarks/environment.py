"""What a result or a bug report depends on: versions, devices, the kernels each device runs, the compile cache.

The one place both the bench's environment (its footer and ``--json``'s ``environment``, :func:`environment`) and
``python -m mindiesd env`` (:func:`report`, :func:`format_report`) are made from, so the two never disagree.

Nothing here compiles the C++ CPU kernels: :func:`cpu_kernels` loads the package build's prebuilt kernels or a
cached build where one loads and otherwise says they are not built yet, unless asked to build them
(``env --build-cpu-kernels``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from typing import Any, Dict, List, Optional

import torch

from .. import __version__ as MINDIESD_VERSION
from ..compilation.storage import cache as _cache
from ..compilation import config as _config
from ..compilation.runtime.device_graph import adapter_for
from ..compilation.report import plural
from ..ops import registry
from ..ops.kernels import cpp as _cpp_kernels

__all__ = ["environment", "report", "format_report", "footer", "cpu_kernels", "triton_kernels", "device_graph"]

#: The device types that have device graphs, and what those are called.
DEVICE_GRAPHS = {"cuda": "CUDA graphs", "npu": "ACLGraph"}


def package_version(name: str) -> Optional[str]:
    """The installed version of distribution ``name`` (its module's ``__version__`` as a fallback), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    module = sys.modules.get(name.replace("-", "_"))
    if module is None and importlib.util.find_spec(name.replace("-", "_")) is None:
        return None
    return getattr(module, "__version__", None) or "installed (version unknown)"


def cpu_kernels(build: bool = False) -> str:
    """The CPU kernel implementation in use: 'C++ prebuilt (<capability>, <n> float lanes)', 'C++ JIT-built (...)',
    'composition (<why>)' or 'not built yet (...)'. Loads the prebuilt kernels or a cached build of them; compiles
    them only with ``build``."""
    return _cpp_kernels.cpu_kernel_implementation(build=build)


def triton_kernels() -> str:
    """Whether the Triton kernels are the ops' CUDA kernels, and why not where they are not."""
    if importlib.util.find_spec("triton") is None:
        return "not registered: Triton is not installed (CUDA runs the reference compositions)"
    registered = registry.DEVICE_KERNELS.get("cuda", {})
    if any(getattr(fn, "__module__", "").endswith(".kernels.triton") for fn in registered.values()):
        return "registered for cuda"
    if not torch.cuda.is_available():
        return "not registered: no CUDA device visible to torch"
    return "not registered: the Triton kernels failed to load (see the warning of import mindiesd.ops)"


def device_graph(device_type: str) -> Optional[str]:
    """Whether device graphs (CUDA graphs, ACLGraph) can be captured on ``device_type``; None where none exist."""
    name = DEVICE_GRAPHS.get(device_type)
    if name is None:
        return None
    if device_type == "npu" and getattr(torch, "npu", None) is None:  # torch.device("npu") needs torch_npu
        if importlib.util.find_spec("torch_npu") is None:
            return f"{name} unavailable: torch_npu is not installed"
        return f"{name} unavailable: torch_npu is installed but was not imported"
    if adapter_for(torch.device(device_type)) is not None:
        return f"{name} available"
    if device_type == "cuda":
        return f"{name} unavailable: no CUDA device visible to torch"
    return f"{name} unavailable: torch_npu has no NPUGraph"


#: The CPU features a quantized figure depends on (torch.cpu's names): torchao picks its int8 product by them.
CPU_FEATURES = (("amx_tile", "AMX tiles"), ("avx512_vnni", "AVX-512 VNNI"), ("avx512_bf16", "AVX-512 BF16"))


def cpu_description() -> str:
    """The CPU's name, ATen's vector capability (AVX2, AVX512, ...) and the int8/bf16 features a figure depends on, e.g.
    ``AMD EPYC, AVX2; amx_tile no, avx512_vnni no, avx512_bf16 no``."""
    try:
        capabilities = torch.cpu.get_capabilities()
    except Exception:  # noqa: BLE001  (a torch without it)
        capabilities = {"amx_tile": torch.cpu._is_amx_tile_supported(), "avx512_vnni": torch.cpu._is_vnni_supported(),
                        "avx512_bf16": torch.cpu._is_avx512_bf16_supported()}
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001
        capability = "unknown"
    name = capabilities.get("cpu_name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = ", ".join(f"{key} {'yes' if capabilities.get(key) else 'no'}" for key, _ in CPU_FEATURES)
    return f"{name}, {capability}; {flags}"


def devices() -> List[str]:
    """The devices torch sees, one line each (the CPU first)."""
    cores = plural(os.cpu_count() or 0, "logical core")
    found = [f"cpu: {platform.machine() or 'unknown'}, {cores}, {cpu_description()}"]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            found.append(f"cuda:{index}: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                         f"compute capability {props.major}.{props.minor}, CUDA {torch.version.cuda}")
    elif torch.version.cuda:
        found.append(f"cuda: no device visible (torch built for CUDA {torch.version.cuda})")
    else:
        found.append("cuda: none (torch built without CUDA)")
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        for index in range(npu.device_count()):
            found.append(f"npu:{index}: {npu.get_device_name(index)}")
    return found


def _kernel_text(op_name: str, device_type: str, fn: Any) -> str:
    op = registry.OPS.get(op_name)
    declared = op.kernels.get(device_type) if op is not None else None
    if declared is None or not declared.declares(fn):
        return f"user kernel {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    module = getattr(fn, "__module__", "").rpartition(".")[2]
    # a device's note covers all its declared kernels; the composition registered alone (C++ kernels off) is named
    text = "aten composition" if module == "cpu" else declared.note or module
    return text if declared.fast else f"{text} [not faster than eager: runs only when forced]"


def kernels() -> Dict[str, Dict[str, str]]:
    """Device type -> {op name: the kernel registered there}, as the registry declares it (user kernels named)."""
    return {device_type: {name: _kernel_text(name, device_type, fn) for name, fn in registered.items()}
            for device_type, registered in sorted(registry.DEVICE_KERNELS.items())}


def compile_cache() -> Dict[str, Any]:
    """The persistent compile cache of ``CompilationConfig.cache_dir``: folder (None: off), entries and bytes."""
    folder, entries, size = _cache.describe(_config.CompilationConfig.cache_dir)
    return {"folder": str(folder) if folder is not None else None, "entries": entries, "bytes": size}


def environment(device: Any = None) -> Dict[str, Any]:
    """The bench's environment (what the numbers depend on): versions, threads, the CPU kernel implementation
    (``cpu_kernels``) and, for a run on ``device``, Triton (cuda) and the device graph (cuda, npu) there."""
    info: Dict[str, Any] = {
        "mindiesd": MINDIESD_VERSION,
        "torch": torch.__version__,
        "diffusers": package_version("diffusers"),
        "threads": torch.get_num_threads(),
        "cpu": cpu_description(),
        "cpu_kernels": cpu_kernels(),
    }
    device_type = str(device).split(":")[0] if device is not None else "cpu"
    if device_type == "cuda":
        info["triton"] = package_version("triton")
        info["triton_kernels"] = triton_kernels()
    graph = device_graph(device_type)
    if graph is not None:
        info["device_graph"] = graph
    return info


def footer(env: Dict[str, Any]) -> str:
    """One line naming the kernels of the bench's ``env``: mindiesd's version, the CPU kernels, and where the run
    had them, Triton and the device graph."""
    parts = [f"mindiesd {env['mindiesd']}", f"CPU: {env['cpu']}" if "cpu" in env else "",
             f"CPU kernels: {env['cpu_kernels']}"]
    parts = [p for p in parts if p]
    if "triton_kernels" in env:
        parts.append(f"triton {env['triton'] or '-'}: {env['triton_kernels']}")
    if "device_graph" in env:
        parts.append(f"device graph: {env['device_graph']}")
    return "; ".join(parts)


def report(build_cpu_kernels: bool = False) -> Dict[str, Any]:
    """Everything a bug report needs: versions, devices, kernels per device, device graphs, the caches.

    ``build_cpu_kernels``: compile the C++ CPU kernels first where neither prebuilt kernels nor a cached build
    load (one-time, a few minutes).
    """
    return {
        "mindiesd": MINDIESD_VERSION,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "diffusers": package_version("diffusers"),
        "triton": package_version("triton"),
        "torch_npu": package_version("torch_npu"),
        "threads": torch.get_num_threads(),
        "devices": devices(),
        "cpu_kernels": cpu_kernels(build=build_cpu_kernels),
        "triton_kernels": triton_kernels(),
        "device_graphs": {device_type: device_graph(device_type) for device_type in DEVICE_GRAPHS},
        "kernels": kernels(),
        "compile_cache": compile_cache(),
        "cpu_kernel_cache": str(_cpp_kernels.cache_root()),
    }


def format_report(info: Dict[str, Any]) -> str:
    """:func:`report` as an aligned listing, one fact a line."""
    rows: List[tuple] = []
    for key in ("mindiesd", "python", "platform", "torch", "diffusers", "triton", "torch_npu", "threads"):
        value = info[key]
        rows.append((key, "not installed" if value is None else str(value)))
    rows.extend(("devices" if i == 0 else "", line) for i, line in enumerate(info["devices"]))
    rows.append(("cpu_kernels", info["cpu_kernels"]))
    rows.append(("triton_kernels", info["triton_kernels"]))
    rows.extend((f"device graph {device_type}", text) for device_type, text in info["device_graphs"].items())
    for device_type, ops in info["kernels"].items():
        rows.extend((f"kernels {device_type}" if i == 0 else "", f"{name}: {text}")
                    for i, (name, text) in enumerate(ops.items()))
    cache = info["compile_cache"]
    if cache["folder"] is None:
        setting = os.environ.get(_config.ENV_VAR)
        rows.append(("compile cache", f"off ({_config.ENV_VAR}={setting!r})" if setting is not None else "off"))
    else:
        entries = cache["entries"]
        rows.append(("compile cache", f"{cache['folder']}: {plural(entries, 'entry', 'entries')}, "
                                      f"{cache['bytes'] / 2**20:.1f} MiB"))
    rows.append(("cpu kernel cache", info["cpu_kernel_cache"]))
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}".rstrip() for key, value in rows)
