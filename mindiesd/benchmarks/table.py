"""Result tables: the short headers of the columns, the formatting of a value, and one renderer (aligned text or
Markdown) shared by every bench mode."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from .common import FAMILIES

#: Column -> its header where the column's name is too long for a table.
HEADERS = {
    "capture_first_s": "capture_first_s",
    "capture_ms": "captured_ms",
    "capture_speedup": "capt/eager",
    "regional_graphs": "reg_graphs",
    "regional_fused": "reg_fused",
    "regional_max_rel_err": "reg_rel_err",
    "regional_compile_s": "reg_compile_s",
    "regional_ms": "regional_ms",
    "regional_speedup": "reg/eager",
    "adalayernorm": "adaln",
    "fast_gelu": "gelu",
    "merge_projections": "merged",
    "linear_gelu": "lin_gelu",
    "cat_linear": "cat_lin",
    "gain_merge_projections": "merge_gain",
    "gain_linear_gelu": "lin_gelu_gain",
    "gain_cat_linear": "cat_lin_gain",
    "fallbacks": "fallback",
    "max_rel_err": "max_rel_err",
    "compile_s": "compile_s",
    "inductor_max_rel_err": "ind_rel_err",
    "inductor_compile_s": "ind_compile_s",
    "inductor_ms": "inductor_ms",
    "compile_vs_inductor": "compile/ind",
    "speed_vs_inductor": "speed/ind",
}


def format_value(column: str, value: Any) -> str:
    """One cell of ``column``: "-" where it does not apply, counts whole, errors in e-notation, ratios with an x,
    spreads in percent."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if column in FAMILIES or column in ("graphs", "fallbacks", "iters", "fused", "regional_graphs", "regional_fused"):
        return str(int(value))
    if column.endswith("rel_err"):
        return f"{value:.1e}"
    if column == "spread":
        return f"{value:.0%}"
    if column in ("speedup", "speed_vs_inductor", "capture_speedup", "regional_speedup") or column.startswith("gain_"):
        return f"{value:.2f}x"
    if column == "compile_vs_inductor":
        return f"{value:.3f}"
    if column.endswith("_s"):
        return f"{value:.2f}"
    if column.endswith("_ms") or column == "capture_ms":
        return f"{value:.2f}"
    return str(value)


def format_rows(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], left: Sequence[str], *,
                headers: Mapping[str, str] = HEADERS, cell: Callable[[str, Any], str] = format_value,
                markdown: bool = False) -> str:
    """``rows`` under ``columns`` (``headers`` renames them; ``left``: the text columns), one ``cell`` each."""
    cells = [[cell(column, row.get(column)) for column in columns] for row in rows]
    return render_table([headers.get(c, c) for c in columns], cells, [c in left for c in columns], markdown)


def render_table(headers: Sequence[str], cells: Sequence[Sequence[str]], left: Sequence[bool],
                 markdown: bool = False) -> str:
    """Cells under headers, aligned (``left``: per column, text columns left, numbers right), or as Markdown."""
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = [v.ljust(w) if l else v.rjust(w) for v, w, l in zip(values, widths, left)]
        return ("| " + " | ".join(padded) + " |") if markdown else "  ".join(padded).rstrip()

    out = [line(headers)]
    if markdown:
        out.append("| " + " | ".join("-" * w if l else "-" * (w - 1) + ":" for w, l in zip(widths, left)) + " |")
    else:
        out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells)
    return "\n".join(out)
