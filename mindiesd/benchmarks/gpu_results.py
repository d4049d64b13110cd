"""``docs/gpu-results.json`` from one GPU check: the op bench's and the model bench's JSON files in one record.

``bench/gpu_check.sh`` runs ``bench ops --json`` and ``bench model --json`` (``wide`` and ``mid`` Flux in bf16,
with ``--capture --vs inductor --vs inductor-ro``), then::

    python -m mindiesd.benchmarks.gpu_results --ops OPS.json --models A.json B.json --out docs/gpu-results.json

The record's fields: ``device``, ``torch``, ``triton``, ``commit`` (the commit measured), ``date``, ``copy_gbps``
(the median over the op rows of a copy of the op's largest input); ``ops``, one object per op row with ``op``,
``shape``, ``dtype``, ``kernel``, ``enabled``, ``eager_ms``, ``fused_ms`` (and the op bench's other columns:
``inductor_ms``, ``copy_ms``, ``fused_gbps``, ``pct_copy_bw``); ``models``, one object per model row with
``model``, ``size``, ``dtype``, ``eager_ms``, ``mindiesd_ms``, ``captured_ms``, ``inductor_ms``, ``inductor_ro_ms``,
``compile_s``, ``inductor_compile_s`` (None where the run did not measure it).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

OP_FIELDS = ("op", "shape", "dtype", "kernel", "enabled", "eager_ms", "fused_ms", "inductor_ms", "copy_ms",
             "fused_gbps", "pct_copy_bw")
#: Model record field -> the model bench's column.
MODEL_FIELDS = {"model": "model", "size": "size", "dtype": "dtype", "eager_ms": "eager_ms",
                "mindiesd_ms": "mindiesd_ms", "captured_ms": "capture_ms", "inductor_ms": "inductor_ms",
                "inductor_ro_ms": "inductor_ro_ms", "compile_s": "compile_s",
                "inductor_compile_s": "inductor_compile_s"}


def _load(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _commit(root: Path) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _triton_version() -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    return getattr(triton, "__version__", None)


def record(ops_payload: Optional[Dict[str, Any]], model_payloads: Sequence[Dict[str, Any]],
           device: Optional[str] = None, commit: Optional[str] = None, date: Optional[str] = None) -> Dict[str, Any]:
    """The results record of one check (see the module doc)."""
    import torch

    op_rows = list((ops_payload or {}).get("rows", ()))
    ops = [{field: row.get(field) for field in OP_FIELDS} for row in op_rows]
    models: List[Dict[str, Any]] = []
    for payload in model_payloads:
        for row in payload.get("rows", ()):
            models.append({field: row.get(column) for field, column in MODEL_FIELDS.items()})
    copies = [row["copy_gbps"] for row in op_rows if isinstance(row.get("copy_gbps"), (int, float))]
    if device is None:
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else (ops_payload or {}).get("device")
    return {
        "device": device, "torch": torch.__version__, "triton": _triton_version(),
        "commit": commit if commit is not None else _commit(Path(__file__).resolve().parents[2]),
        "date": date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "copy_gbps": statistics.median(copies) if copies else None, "ops": ops, "models": models,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..compilation.report import plural

    parser = argparse.ArgumentParser(prog="python -m mindiesd.benchmarks.gpu_results", description=__doc__.split("\n")[0])
    parser.add_argument("--ops", metavar="JSON", default=None, help="the op bench's --json file")
    parser.add_argument("--models", metavar="JSON", nargs="*", default=(), help="the model bench's --json files")
    parser.add_argument("--out", metavar="PATH", required=True, help="where to write the record")
    args = parser.parse_args(argv)
    missing = [p for p in ([args.ops] if args.ops else []) + list(args.models) if not Path(p).is_file()]
    for path in missing:
        print(f"gpu_results: {path} is missing (its step failed or was skipped); left out", file=sys.stderr)
    ops = _load(args.ops) if args.ops and args.ops not in missing else None
    models = [_load(p) for p in args.models if p not in missing]
    result = record(ops, models)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"gpu_results: {plural(len(result['ops']), 'op row')}, {plural(len(result['models']), 'model row')} "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
