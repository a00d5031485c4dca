"""What the benchmark scripts print: fixed-width tables, their cells, lengths (``32K``) and byte
counts (``3.00 GiB``)."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence


def fmt_len(s: int) -> str:
    return f"{s // 1024}K" if s % 1024 == 0 and s >= 1024 else str(s)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: Optional[str] = None) -> str:
    """A plain fixed-width table; ``align`` is a string of 'l'/'r' per column (default: first left)."""
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    align = align or ("l" + "r" * (len(headers) - 1))

    def line(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def table_cell(row: Optional[dict], key: str = "ms", fmt="{:.3f}") -> str:
    """A table cell: ``row[key]`` formatted (``fmt``: a format string or a function), or the row's
    status (``n/a``, ``OOM``, ``err``) when it failed; ``-`` without a row or without the number."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return {"n/a": "n/a", "oom": "OOM", "error": "err"}.get(row["status"], row["status"])
    if row.get(key) is None:
        return "-"
    return fmt(row[key]) if callable(fmt) else fmt.format(row[key])


def shorten(text: Optional[str], limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters (with ``...``) for a table cell."""
    text = text or ""
    return text if len(text) <= limit else text[: limit - 3] + "..."
