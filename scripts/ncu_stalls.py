"""Condenses `ncu --csv --page raw --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active`
output to the largest warp stall reasons per kernel (warps stalled on each reason per issued
instruction: where the issue slots go).

    ncu --clock-control none --csv --page raw --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio' \\
        python3 scripts/profile_expert_gemm.py > stalls.csv && python3 scripts/ncu_stalls.py stalls.csv
"""

from __future__ import annotations

import csv
import re
import sys

PATTERN = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def main(path: str, top: int = 8) -> None:
    with open(path, newline="") as handle:
        lines = [line for line in handle if line.startswith('"')]
    rows = list(csv.reader(lines))
    header, units, data = rows[0], rows[1], rows[2:]
    name_col = header.index("Kernel Name")
    for row in data:
        stalls, others = {}, {}
        for column, value in zip(header, row):
            match = PATTERN.fullmatch(column)
            try:
                number = float(value.replace(",", ""))
            except ValueError:
                continue
            if match:
                stalls[match.group(1)] = number
            elif column.endswith((".avg.pct_of_peak_sustained_active", ".avg.pct_of_peak_sustained_elapsed",
                                  "__time_duration.sum", ".avg.per_second")):  # pipe activity, throughputs, time, clock
                others[column] = number
        total = sum(stalls.values())
        best = sorted(stalls.items(), key=lambda kv: -kv[1])[:top]
        print(f"{row[name_col][:90]}\n  total {total:.2f} warps stalled per issue: " + ", ".join(f"{k} {v:.2f}" for k, v in best))
        if others:
            print("  " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(others.items())))


if __name__ == "__main__":
    main(sys.argv[1])
