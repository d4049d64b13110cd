"""The persistent cache's key hashes the product's sources only: editing the tooling keeps users' entries."""

from __future__ import annotations

import shutil
from pathlib import Path

import mindiesd
from mindiesd.compilation.storage.cache import _source_hash

PACKAGE = Path(mindiesd.__file__).resolve().parent


def _copy_of_the_package(tmp_path: Path) -> Path:
    root = tmp_path / "mindiesd"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _append(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text)


def test_the_copy_hashes_like_the_package(tmp_path):
    assert _source_hash(_copy_of_the_package(tmp_path)) == _source_hash()


def test_a_changed_bench_or_zoo_model_keeps_the_hash(tmp_path):
    root = _copy_of_the_package(tmp_path)
    before = _source_hash(root)
    _append(root / "benchmarks" / "models.py", "\nEDITED = True\n")
    _append(root / "benchmarks" / "new_mode.py", "EDITED = True\n")
    _append(root / "zoo" / "__init__.py", "\nEDITED = True\n")
    _append(root / "__main__.py", "\nEDITED = True\n")
    assert _source_hash(root) == before


def test_a_changed_pass_op_or_kernel_changes_the_hash(tmp_path):
    root = _copy_of_the_package(tmp_path)
    hashes = {_source_hash(root)}
    cpp, header = next(root.glob("ops/**/*.cpp")), next(root.glob("ops/**/*.h"))
    for edited in (root / "compilation" / "__init__.py", root / "ops" / "__init__.py", cpp, header,
                   root / "__init__.py"):
        _append(edited, "\n// edited\n" if edited.suffix in (".cpp", ".h") else "\nEDITED = True\n")
        hashes.add(_source_hash(root))
    assert len(hashes) == 6
