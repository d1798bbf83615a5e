"""The SASS instructions where a kernel's warps stall most, from ncu's source page (PC sampling):
the top instructions by stall samples, each with its largest stall reasons. For finding which part of
a kernel (the MMAs' wait, the promotion, a scale load, the epilogue's stores) holds the warps.

    ncu --section SourceCounters --section WarpStateStats --kernel-name regex:NAME --launch-count 1 \\
        -o prof python3 scripts/profile_expert_gemm.py ...
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 scripts/ncu_hot_sass.py sass.csv [TOP]
"""

from __future__ import annotations

import csv
import sys


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main(path: str, top: int = 40) -> None:
    with open(path, newline="") as handle:
        rows = [row for row in csv.reader(handle) if row]
    # The page may hold one table per kernel: each starts with a header row naming "Source".
    tables, current = [], None
    for row in rows:
        if "Source" in row and any("Sampling" in cell for cell in row):
            current = {"header": row, "rows": []}
            tables.append(current)
        elif current is not None:
            current["rows"].append(row)
    if not tables:
        print(f"no table with a Source column and stall sampling in {path}; its first rows:")
        for row in rows[:6]:
            print("  " + " | ".join(cell[:40] for cell in row[:30]))
    for table in tables:
        header = table["header"]
        source = header.index("Source")
        samples = next(i for i, name in enumerate(header) if "Sampling (All" in name)
        reasons = [i for i, name in enumerate(header) if "stall" in name.lower() and i != samples
                   and "Sampling" not in name]
        data = [row for row in table["rows"] if len(row) == len(header) and number(row[samples]) is not None]
        total = sum(number(row[samples]) for row in data) or 1.0
        print(f"== {len(data)} instructions, {total:.0f} stall samples; top {top}:")
        for row in sorted(data, key=lambda r: -number(r[samples]))[:top]:
            share = number(row[samples]) / total
            why = sorted(((number(row[i]) or 0.0, header[i]) for i in reasons), reverse=True)[:3]
            why_text = ", ".join(f"{name} {value:.0f}" for value, name in why if value > 0)
            address = row[header.index("Address")] if "Address" in header else ""
            print(f"{share:6.1%}  {address:>6}  {row[source][:70]:70}  {why_text}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
