"""Tests of the prebuilt C++ CPU kernels: setup.py's part, the manifest, which module loads, and the fallbacks.

Nothing here compiles the kernels. The tests of the installed modules run where the package build made them
(``pip install --no-build-isolation``, or ``python setup.py build_ext --inplace`` in a checkout) and are skipped
elsewhere, unless ``MINDIESD_TEST_PREBUILT=required`` (CI, which installs that way) makes their absence a failure.
The refusal and fallback tests use manifests of their own in temporary folders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch

from mindiesd.ops import reference
from mindiesd.ops.kernels import cpp_build as _cpp_build, cpu as _cpu

REPO = Path(__file__).resolve().parents[2]
INSTALLED = _cpp_build.PREBUILT_DIR / _cpp_build.MANIFEST
DISABLED = not _cpp_build.enabled()


def _installed_manifest() -> dict:
    """The installed manifest; skips (or fails, where CI requires prebuilt kernels) where there is none."""
    if DISABLED:
        pytest.skip(f"C++ kernels are disabled by {_cpp_build.ENABLE_ENV}")
    if not INSTALLED.exists():
        message = f"no prebuilt C++ kernels in {INSTALLED.parent} (the package was built without torch)"
        if os.environ.get("MINDIESD_TEST_PREBUILT") == "required":
            pytest.fail(message)
        pytest.skip(message)
    return json.loads(INSTALLED.read_text())


def _runnable_tags() -> tuple[str, ...]:
    """This machine's tag and the ones below it: the modules it can run."""
    tag = _cpp_build._capability_tag()
    return _cpp_build.TAGS[_cpp_build.TAGS.index(tag):]


@pytest.fixture
def fresh_loader():
    """A loader that has loaded nothing yet; the real state is loaded again afterwards."""
    _cpp_build._reset()
    yield
    _cpp_build._reset()


def _prebuilt_folder(tmp_path: Path, modules: dict[str, str], **changes) -> Path:
    """A folder with a manifest of this torch, Python and sources (less ``changes``) listing ``modules``."""
    folder = tmp_path / "prebuilt"
    folder.mkdir(exist_ok=True)
    _cpp_build.write_manifest(folder, modules)
    manifest = json.loads((folder / _cpp_build.MANIFEST).read_text())
    manifest.update(changes)
    (folder / _cpp_build.MANIFEST).write_text(json.dumps(manifest))
    return folder


def _no_jit(monkeypatch, tmp_path):
    """No cached JIT build, and a build that fails as it would without a compiler."""
    monkeypatch.setenv(_cpp_build.CACHE_ENV, str(tmp_path / "jit-cache"))
    monkeypatch.setattr(_cpp_build, "_import_built", lambda name, directory: None)

    def failing_compile(name, flags, directory):
        raise RuntimeError("simulated JIT failure")

    monkeypatch.setattr(_cpp_build, "_compile", failing_compile)


# ----------------------------------------------------------------------------
# The installed modules
# ----------------------------------------------------------------------------


def test_installed_prebuilt_kernels_are_the_ones_in_use(cpu_kernel_build):
    manifest = _installed_manifest()
    assert {key: manifest[key] for key in ("torch", "torch_git", "python", "sources")} == _cpp_build.build_facts()
    assert cpu_kernel_build.startswith("C++ prebuilt (")
    module = _cpp_build.extension()
    assert module.__name__.startswith("mindiesd.ops.kernels._cpu_kernels_")
    assert Path(module.__file__).parent == INSTALLED.parent
    assert Path(module.__file__).name == manifest["modules"][module.__name__.rpartition("_cpu_kernels_")[2]]
    x = torch.randn(3, 40)
    torch.testing.assert_close(torch.ops.mindiesd.fast_gelu.default(x), reference.fast_gelu(x))


def test_prebuilt_kernels_cover_every_instruction_set():
    manifest = _installed_manifest()
    if _cpp_build._capability_tag() == "default":  # not x86-64 (or a CPU without AVX2): only the default one
        assert "default" in manifest["modules"]
    else:
        assert {"avx512", "avx2", "default"} <= set(manifest["modules"]) <= set(_cpp_build.TAGS)


@pytest.mark.parametrize("tag", _cpp_build.TAGS)
def test_each_prebuilt_module_this_cpu_runs_passes_the_self_check(tag):
    manifest = _installed_manifest()
    if tag not in manifest["modules"]:
        pytest.skip(f"no prebuilt module for {tag} (the compiler rejected its flags)")
    if tag not in _runnable_tags():
        pytest.skip(f"this CPU cannot run the {tag} module")
    module = _cpp_build._import_extension(
        _cpp_build.prebuilt_module_name(tag), INSTALLED.parent / manifest["modules"][tag]
    )
    expected = {"avx512bf16": "AVX512+BF16", "avx512": "AVX512", "avx2": "AVX2", "default": "DEFAULT"}[tag]
    assert module.capability() == expected
    _cpp_build._self_check(module)


def test_a_lower_prebuilt_module_serves_a_better_cpu(monkeypatch, tmp_path, fresh_loader):
    manifest = _installed_manifest()
    if "avx2" not in _runnable_tags() or "avx2" not in manifest["modules"]:
        pytest.skip("this CPU does not run the AVX2 module")
    # the installed AVX2 module, by its full path (the folder's own modules are named relative to it)
    folder = _prebuilt_folder(tmp_path, {"avx2": str(INSTALLED.parent / manifest["modules"]["avx2"])})
    monkeypatch.setattr(_cpp_build, "PREBUILT_DIR", folder)
    monkeypatch.setattr(_cpp_build, "_capability_tag", lambda: "avx512bf16")
    _no_jit(monkeypatch, tmp_path)
    assert _cpp_build.cpu_kernel_implementation() == "C++ prebuilt (AVX2, 8 float lanes)"


# ----------------------------------------------------------------------------
# Refusals: the manifest is checked before any module is loaded
# ----------------------------------------------------------------------------


def _garbage_module(tmp_path: Path, tag: str) -> str:
    """A module file in the prebuilt folder that would fail to import: a refusal must not even try it."""
    name = f"{_cpp_build.PREBUILT_PREFIX}{tag}.so"
    (tmp_path / "prebuilt").mkdir(exist_ok=True)
    (tmp_path / "prebuilt" / name).write_bytes(b"not a shared object")
    return name


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"torch": "2.0.0"}, f"built against torch 2.0.0, this is torch {torch.__version__}"),
        ({"torch_git": "0123abc"}, f"built against torch {torch.__version__}, this is torch {torch.__version__}"),
        ({"python": "cpython-39"}, f"built for cpython-39, this is {sys.implementation.cache_tag}"),
        ({"sources": "0" * 64}, "the C++ sources changed since they were built"),
    ],
)
def test_prebuilt_kernels_of_another_build_are_refused(monkeypatch, tmp_path, changes, reason):
    tag = _cpp_build._capability_tag()
    folder = _prebuilt_folder(tmp_path, {tag: _garbage_module(tmp_path, tag)}, **changes)
    monkeypatch.setattr(_cpp_build, "PREBUILT_DIR", folder)
    assert _cpp_build._load_prebuilt() == (None, reason)


def test_prebuilt_refusals_without_a_usable_module(monkeypatch, tmp_path):
    monkeypatch.setattr(_cpp_build, "PREBUILT_DIR", tmp_path / "prebuilt")
    assert _cpp_build._load_prebuilt() == (None, None)  # nothing installed: no refusal to report
    folder = _prebuilt_folder(tmp_path, {})
    monkeypatch.setattr(_cpp_build, "_capability_tag", lambda: "avx2")
    assert _cpp_build._load_prebuilt() == (None, "none built for avx2 or a capability below it (built: none)")
    _prebuilt_folder(tmp_path, {"avx512": "_cpu_kernels_avx512.so"})
    assert _cpp_build._load_prebuilt()[1] == "none built for avx2 or a capability below it (built: avx512)"
    _prebuilt_folder(tmp_path, {"avx2": _garbage_module(tmp_path, "avx2")})
    module, reason = _cpp_build._load_prebuilt()
    assert module is None and reason.startswith("_cpu_kernels_avx2.so does not load: ")
    (folder / _cpp_build.MANIFEST).write_text("{not json")
    assert _cpp_build._load_prebuilt()[1].startswith(f"unreadable {folder / _cpp_build.MANIFEST}: ")


# ----------------------------------------------------------------------------
# Fallbacks: the JIT build, then the composition kernels
# ----------------------------------------------------------------------------


def _jit_stand_in(module_name: str):
    """What the JIT build returns, made of the kernels of this process (no compile)."""
    real = _cpp_build.extension()
    if real is None:
        pytest.skip(f"C++ CPU kernels unavailable: {_cpp_build.cpu_kernel_implementation()}")
    stand_in = types.ModuleType(module_name)
    # every op with a C++ kernel (the self-check runs each), and the build's own entry points
    for name in (*_cpp_build.SELF_CHECKS, "capability", "vector_lanes", "set_streaming_threshold",
                 "streaming_threshold"):
        setattr(stand_in, name, getattr(real, name))
    return stand_in


@pytest.mark.skipif(DISABLED, reason="C++ kernels disabled")
def test_prebuilt_for_another_torch_falls_back_to_the_jit_build(monkeypatch, tmp_path, capsys):
    stand_in = _jit_stand_in("mindiesd_cpu_kernels_stand_in")
    _cpp_build._reset()
    try:
        tag = _cpp_build._capability_tag()
        folder = _prebuilt_folder(tmp_path, {tag: _garbage_module(tmp_path, tag)}, torch="2.0.0")
        monkeypatch.setattr(_cpp_build, "PREBUILT_DIR", folder)
        monkeypatch.setenv(_cpp_build.CACHE_ENV, str(tmp_path / "jit-cache"))
        monkeypatch.setattr(_cpp_build, "_import_built", lambda name, directory: None)
        monkeypatch.setattr(_cpp_build, "_missing_tool", lambda: None)
        built = []
        monkeypatch.setattr(_cpp_build, "_compile", lambda name, flags, directory: built.append(name) or stand_in)
        x = torch.randn(2, 5, 40)
        torch.testing.assert_close(torch.ops.mindiesd.fast_gelu.default(x), reference.fast_gelu(x))
        assert len(built) == 1
        err = capsys.readouterr().err
        refusal = f"built against torch 2.0.0, this is torch {torch.__version__}"
        assert f"mindiesd: not using the prebuilt CPU kernels ({refusal})" in err
        assert "mindiesd: building mindiesd CPU kernels (one-time" in err
        implementation = _cpp_build.cpu_kernel_implementation(build=False)
        assert implementation.startswith("C++ JIT-built (")
        assert implementation.endswith(f"; prebuilt kernels not used: {refusal}")
    finally:
        _cpp_build._reset()


@pytest.mark.skipif(DISABLED, reason="C++ kernels disabled")
def test_prebuilt_refused_and_jit_failing_gives_compositions_with_one_warning(monkeypatch, tmp_path, fresh_loader):
    tag = _cpp_build._capability_tag()
    folder = _prebuilt_folder(tmp_path, {tag: _garbage_module(tmp_path, tag)}, torch="2.0.0")
    monkeypatch.setattr(_cpp_build, "PREBUILT_DIR", folder)
    monkeypatch.setattr(_cpp_build, "_missing_tool", lambda: None)
    _no_jit(monkeypatch, tmp_path)
    x, weight = torch.randn(2, 5, 40), torch.randn(40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = torch.ops.mindiesd.rms_norm.default(x, weight, 1e-6)
        second = torch.ops.mindiesd.fast_gelu.default(x)
    messages = [str(w.message) for w in caught if "C++ CPU kernels" in str(w.message)]
    assert len(messages) == 1, messages
    assert "simulated JIT failure" in messages[0] and "built against torch 2.0.0" in messages[0]
    torch.testing.assert_close(first, _cpu.rms_norm(x, weight, 1e-6))
    torch.testing.assert_close(second, reference.fast_gelu(x))
    assert _cpp_build.cpu_kernel_implementation().startswith("composition (simulated JIT failure")


@pytest.mark.skipif(DISABLED, reason="C++ kernels disabled")
def test_report_without_build_names_the_refusal(monkeypatch, tmp_path, fresh_loader):
    tag = _cpp_build._capability_tag()
    folder = _prebuilt_folder(tmp_path, {tag: _garbage_module(tmp_path, tag)}, sources="0" * 64)
    monkeypatch.setattr(_cpp_build, "PREBUILT_DIR", folder)
    monkeypatch.setattr(_cpp_build, "_missing_tool", lambda: None)
    _no_jit(monkeypatch, tmp_path)
    assert _cpp_build.cpu_kernel_implementation(build=False) == (
        f"not built yet (the C++ kernels for {tag} build on the first CPU kernel call; "
        "prebuilt kernels not used: the C++ sources changed since they were built)"
    )


# ----------------------------------------------------------------------------
# setup.py
# ----------------------------------------------------------------------------


def _run_setup_functions(script: str) -> subprocess.CompletedProcess:
    """Run ``script`` with setup.py's functions loaded (not its setup() call: nothing is built)."""
    code = f"import runpy\nglobals().update(runpy.run_path({str(REPO / 'setup.py')!r}))\n" + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_setup_without_torch_builds_nothing_and_says_so():
    result = _run_setup_functions(
        """
        import sys
        sys.modules["torch"] = None  # as in pip's isolated build environment
        assert kernel_extensions() == []
        assert kernel_build_command().__name__ == "build_ext"
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    lines = [line for line in result.stderr.splitlines() if line.startswith("mindiesd:")]
    assert len(lines) == 1 and "no C++ CPU kernels are prebuilt" in lines[0]
    assert "JIT-built on first use" in lines[0] and "--no-build-isolation" in lines[0]


def test_setup_declares_one_module_per_instruction_set():
    result = _run_setup_functions(
        """
        import json
        print(json.dumps({ext.name: ext.extra_compile_args for ext in kernel_extensions()}))
        """
    )
    assert result.returncode == 0, result.stderr
    extensions = json.loads(result.stdout)
    if not extensions:
        pytest.skip(f"setup.py builds nothing here: {result.stderr.strip()}")
    for name, flags in extensions.items():
        tag = name.rpartition(_cpp_build.PREBUILT_PREFIX)[2]
        assert name == _cpp_build.prebuilt_module_name(tag)
        assert flags == _cpp_build.capability_flags(tag)  # the JIT build's flags for that instruction set
    assert "mindiesd.ops.kernels._cpu_kernels_default" in extensions


def test_the_package_build_loads_the_build_module_alone():
    """setup.py loads ``cpp_build.py`` by its path, outside the package: it may import nothing of the package at
    module level (a relative import there fails the install)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mindiesd_setup_cpp_build_check", Path(_cpp_build.__file__))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.build_name()[0] == _cpp_build.build_name()[0]
    assert module.sources_digest() == _cpp_build.sources_digest()


def test_a_second_package_build_reuses_a_module_built_from_the_same_sources_torch_and_flags(tmp_path):
    """setup.py's reuse (a second editable install of one tree compiles nothing): a module is reused only where the
    manifest beside it names these sources, this torch and Python, and the same compiler command for its tag."""
    command = ["c++", "-O3", "-mavx2"]
    folder = tmp_path / "prebuilt"
    folder.mkdir()
    (folder / "_cpu_kernels_avx2.so").write_bytes(b"module")
    _cpp_build.write_manifest(folder, {"avx2": "_cpu_kernels_avx2.so"}, {"avx2": command})
    assert _cpp_build.reusable_module(folder, "avx2", command) == folder / "_cpu_kernels_avx2.so"
    assert _cpp_build.reusable_module(folder, "avx2", [*command, "-mfma"]) is None  # other flags
    assert _cpp_build.reusable_module(folder, "avx512", command) is None  # not built for that tag
    manifest = json.loads((folder / _cpp_build.MANIFEST).read_text())
    for key, other in (("sources", "0" * 64), ("torch", "2.0.0"), ("python", "cpython-30")):
        (folder / _cpp_build.MANIFEST).write_text(json.dumps({**manifest, key: other}))
        assert _cpp_build.reusable_module(folder, "avx2", command) is None, key
    (folder / _cpp_build.MANIFEST).write_text(json.dumps(manifest))
    (folder / "_cpu_kernels_avx2.so").unlink()
    assert _cpp_build.reusable_module(folder, "avx2", command) is None  # the module itself is gone
    (folder / _cpp_build.MANIFEST).write_text("{not json")
    assert _cpp_build.reusable_module(folder, "avx2", command) is None
