"""Package build: everything is in pyproject.toml except the prebuilt C++ CPU kernels, built here.

Where torch is importable in the build environment (install torch first, then
``pip install --no-build-isolation ...``), ``build_ext`` compiles the sources
of ``mindiesd/ops/_cpp`` once per instruction set into the extension modules
``mindiesd/ops/kernels/_cpu_kernels_<tag>`` (tags: ``cpp_build.TAGS`` that the
compiler accepts, with the flags the JIT build uses for them) and writes
``_cpu_kernels.json`` beside them: the torch version, Python ABI and sources
they were built from, which the loader checks before it loads one.  Where
torch is not importable (pip's isolated build environment) or no C++ compiler
is found, nothing is compiled and one line says that the kernels will be
JIT-built on first use.  ``MAX_JOBS`` limits the parallel compiler jobs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
SOURCE_DIR = "mindiesd/ops/_cpp"
PACKAGE = "mindiesd.ops.kernels"
JIT_NOTE = "the C++ CPU kernels will be JIT-built on first use"
#: Flags of Python's own build that the kernels do not use (nor does their JIT build).
UNWANTED_FLAGS = {"-Wall", "-Wsign-compare", "-fwrapv"}


#: Whether to say why nothing is prebuilt: only in the run that builds (pip also runs this file for the
#: build requirements and the metadata).
ANNOUNCE = [True]
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def say(text: str) -> None:
    """One line on stderr, and on the terminal where pip hides the build's output (without ``-v``)."""
    line = f"mindiesd: {text}"
    print(line, file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as terminal:  # no terminal (CI, a pipe): stderr alone
            terminal.write(line + "\n")
    except OSError:
        pass


def say_why_nothing_is_built(text: str) -> None:
    if ANNOUNCE[0]:
        say(text)


def load_cpp_build():
    """``mindiesd/ops/kernels/cpp_build.py`` alone (it needs torch, not the rest of mindiesd), or None with a
    line saying why where torch is not importable."""
    try:
        importlib.import_module("torch")
    except Exception as error:  # noqa: BLE001  (absent, or broken: build nothing)
        say_why_nothing_is_built(
            f"torch is not importable in this build environment ({type(error).__name__}), so no C++ CPU kernels "
            f"are prebuilt; {JIT_NOTE} (to prebuild them: install torch first, then pip install "
            "--no-build-isolation)"
        )
        return None
    path = ROOT / "mindiesd" / "ops" / "kernels" / "cpp_build.py"
    spec = importlib.util.spec_from_file_location("mindiesd_setup_cpp_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CPP_BUILD: list = []


def cpp_build_module():
    """:func:`load_cpp_build`, once."""
    if not _CPP_BUILD:
        _CPP_BUILD.append(load_cpp_build())
    return _CPP_BUILD[0]


def compiler_accepts(compiler: str, flags: list[str]) -> bool:
    """Whether ``compiler`` compiles a trivial C++ file with ``flags``."""
    try:
        result = subprocess.run(
            [compiler, *flags, "-x", "c++", "-fsyntax-only", "-"],
            input="int main() { return 0; }\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


def kernel_tags(cpp_build, compiler: str) -> list[str]:
    """The tags to build for: every tag on x86-64 (less those whose flags the compiler rejects, e.g.
    ``-mavx512bf16`` on an old one), only ``default`` elsewhere."""
    platform = sysconfig.get_platform().lower()
    tags = cpp_build.TAGS if ("x86_64" in platform or "amd64" in platform) else ("default",)
    return [tag for tag in tags if compiler_accepts(compiler, cpp_build.capability_flags(tag))]


def kernel_extensions() -> list:
    """One extension module per instruction set; [] (after one line saying why) where they cannot be built."""
    cpp_build = cpp_build_module()
    if cpp_build is None:
        return []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        say_why_nothing_is_built(
            f"no C++ compiler found (looked for {compiler!r}; set CXX to choose one), so no C++ CPU kernels are "
            f"prebuilt; {JIT_NOTE}"
        )
        return []
    tags = kernel_tags(cpp_build, compiler)
    if not tags:
        say_why_nothing_is_built(
            f"{compiler} rejects the flags of every instruction set, so no C++ CPU kernels are prebuilt; {JIT_NOTE}"
        )
        return []
    from torch.utils.cpp_extension import CppExtension

    sources = [f"{SOURCE_DIR}/{name}" for name in cpp_build.SOURCES]
    headers = [f"{SOURCE_DIR}/{name}" for name in cpp_build.HEADERS]
    return [
        CppExtension(
            f"{PACKAGE}.{cpp_build.PREBUILT_PREFIX}{tag}",
            sources,
            depends=headers,
            extra_compile_args=cpp_build.capability_flags(tag),
            extra_link_args=list(cpp_build.LINK_FLAGS),
        )
        for tag in tags
    ]


def kernel_build_command():
    """torch's ``BuildExtension`` (ninja, parallel compiles), with one temporary folder per module (the same
    sources are compiled with each instruction set's flags) and the manifest written next to the modules."""
    try:
        from torch.utils.cpp_extension import BuildExtension
    except Exception:  # noqa: BLE001  (no torch: there is nothing to build)
        return build_ext

    class KernelBuild(BuildExtension):
        def build_extensions(self) -> None:
            # Python's own CFLAGS (debug info, -Wall, -fwrapv) would make the modules 16x larger, the build
            # slower and the torch headers warn thousands of times: compile with the JIT build's flags.
            for name in getattr(self.compiler, "executables", {}):
                command = getattr(self.compiler, name, None)
                if isinstance(command, list) and command:
                    kept = [flag for flag in command[1:] if flag not in UNWANTED_FLAGS and not flag.startswith("-g")]
                    self.compiler.set_executable(name, [command[0], *kept])
            super().build_extensions()

        def _command(self, ext) -> list[str]:
            return [os.environ.get("CXX", "c++"), *ext.extra_compile_args, *ext.extra_link_args]

        def _reuse(self, ext) -> bool:
            """Copy the module an earlier build of these sources left in the source tree (an editable install
            before this one) to where this build puts it; False where there is none to reuse."""
            cpp_build = cpp_build_module()
            inplace_file, regular_file = self._get_inplace_equivalent(self.get_finalized_command("build_py"), ext)
            tag = ext.name.rpartition(cpp_build.PREBUILT_PREFIX)[2]
            found = cpp_build.reusable_module(Path(inplace_file).parent, tag, self._command(ext))
            if found is None or found.name != os.path.basename(inplace_file):
                return False
            target = inplace_file if self.inplace else regular_file
            if os.path.abspath(target) != os.path.abspath(found):
                os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
                shutil.copyfile(found, target)
            return True

        def build_extension(self, ext) -> None:
            index = self.extensions.index(ext) + 1
            if self._reuse(ext):
                say(f"C++ CPU kernels {ext.name} ({index} of {len(self.extensions)}): reused from the last build "
                    "(same sources, torch and flags)")
                return
            say(f"compiling C++ CPU kernels {ext.name} ({index} of {len(self.extensions)}; about 2.5 minutes each on "
                "2 cores)")
            temp, self.build_temp = self.build_temp, os.path.join(self.build_temp, ext.name.rpartition(".")[2])
            start = time.perf_counter()
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = temp
            say(f"built {ext.name} in {time.perf_counter() - start:.0f} s")

        def _manifest_paths(self) -> tuple[str, str]:
            """(regular, in-place) path of the manifest: beside the built modules in build_lib and in the
            source tree (an editable install's modules are copied there)."""
            build_py = self.get_finalized_command("build_py")
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, self.extensions[0])
            name = cpp_build_module().MANIFEST
            return os.path.join(os.path.dirname(regular_file), name), os.path.join(os.path.dirname(inplace_file), name)

        def run(self) -> None:
            super().run()
            if not self.extensions:
                return
            cpp_build = cpp_build_module()
            modules = {
                ext.name.rpartition(cpp_build.PREBUILT_PREFIX)[2]: os.path.basename(self.get_ext_filename(ext.name))
                for ext in self.extensions
            }
            regular, inplace = self._manifest_paths()
            commands = {tag: self._command(ext) for tag, ext in zip(modules, self.extensions)}
            cpp_build.write_manifest(Path(regular).parent, modules, commands)
            if self.inplace:
                self.copy_file(regular, inplace, level=self.verbose)
            say(f"prebuilt C++ CPU kernels for {', '.join(modules)}; manifest {inplace if self.inplace else regular}")

        def get_outputs(self) -> list[str]:
            outputs = super().get_outputs()
            return outputs + [self._manifest_paths()[0]] if self.extensions else outputs

        def get_output_mapping(self) -> dict[str, str]:
            mapping = super().get_output_mapping()
            if self.extensions and self.inplace:
                regular, inplace = self._manifest_paths()
                mapping[regular] = inplace
            return mapping

    return KernelBuild


if __name__ == "__main__":
    ANNOUNCE[0] = bool(BUILD_COMMANDS.intersection(sys.argv[1:]))
    setup(ext_modules=kernel_extensions(), cmdclass={"build_ext": kernel_build_command()})
