"""Condenses `ncu --csv` output to one line per kernel: duration, SM and memory throughput, tensor pipe."""

from __future__ import annotations

import csv
import sys
from collections import OrderedDict

WANTED = {
    "Duration": "us",
    "Compute (SM) Throughput": "SM%",
    "Memory Throughput": "mem%",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor%",
}


def main(path: str) -> None:
    kernels: "OrderedDict[str, dict]" = OrderedDict()
    with open(path, newline="") as handle:
        lines = [line for line in handle if line.startswith('"')]
    for row in csv.DictReader(lines):
        key = f"{row['ID']:>3} {row['Kernel Name'][:70]}"
        name = row["Metric Name"]
        if name in WANTED:
            value = float(row["Metric Value"].replace(",", ""))
            if name == "Duration" and row["Metric Unit"] == "ms":
                value *= 1e3
            elif name == "Duration" and row["Metric Unit"] == "ns":
                value /= 1e3
            kernels.setdefault(key, {})[WANTED[name]] = value
    print(f"{'kernel':<75} {'us':>9} {'SM%':>6} {'mem%':>6} {'tensor%':>8}")
    total = 0.0
    for key, m in kernels.items():
        total += m.get("us", 0.0)
        print(f"{key:<75} {m.get('us', 0):9.1f} {m.get('SM%', 0):6.1f} {m.get('mem%', 0):6.1f} {m.get('tensor%', 0):8.1f}")
    print(f"{'total (kernel time, serialized by ncu)':<75} {total:9.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
