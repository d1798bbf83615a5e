"""How many launches CUDA queues behind a kernel that has not finished before the host blocks: the
constraint of megatron_mok.emulation's symmetric form (its docstring), where a rank's stream waits on
the device for a rank launched later from the same thread.

    python scripts/probe_launch_queue.py [--streams 1,3]

Per stream count S: each of S streams starts with a sleeping kernel (torch.cuda._sleep, about a
second), then tiny kernels are launched round-robin over the S streams; printed: the launch (counted
over all streams) at which one launch first took over 0.2 s of host time, i.e. the queue was full.
"""

from __future__ import annotations

import argparse
import time

import torch


def first_blocking_launch(num_streams: int, max_launches: int = 8192, sleep_cycles: int = 2_000_000_000) -> int | None:
    x = torch.zeros(1, device="cuda")
    # The tiny kernel launched once before: its module's first (lazy) load would otherwise wait for
    # the sleeping kernels and read as a full queue at launch 1.
    x.add_(1)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(num_streams)]
    for stream in streams:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(sleep_cycles)
    blocked = None
    for launch in range(max_launches):
        with torch.cuda.stream(streams[launch % num_streams]):
            begin = time.perf_counter()
            x.add_(1)
            if blocked is None and time.perf_counter() - begin > 0.2:
                blocked = launch + 1
    torch.cuda.synchronize()
    return blocked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,3", help="stream counts, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_launch_queue.py needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}")
    print("| streams | first launch that blocked the host (over all streams) |")
    print("| ---: | ---: |")
    for count in (int(s) for s in args.streams.split(",")):
        blocked = first_blocking_launch(count)
        print(f"| {count} | {blocked if blocked is not None else 'none of 8192'} |")


if __name__ == "__main__":
    main()
