"""What a gloo all-reduce costs on this machine, against the ``cpu_gloo`` system file's prior.

For each world size it starts itself under torchrun (gloo on loopback, one thread per process, as CONA's
CPU workers run when there are more of them than cores), times ``--calls`` all-reduces of a few message
sizes after a warm-up, and prints each one's milliseconds, the seconds per ring hop it implies (an
all-reduce of ``n`` ranks is ``2(n - 1)`` hops in the performance model) and that over the file's per-hop
latency::

    .venv/bin/python bench/gloo_latency.py --world-sizes 2,4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SIZES = (1, 8192, 65536, 262144)
"""Elements (fp32) per all-reduce: a scalar, and messages of 32 KB to 1 MB."""


def measure(calls: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for numel in SIZES:
        tensor = torch.ones(numel)
        for _ in range(20):
            dist.all_reduce(tensor)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(tensor)
        seconds = (time.perf_counter() - start) / calls
        if dist.get_rank() == 0:
            print(json.dumps({"world": dist.get_world_size(), "bytes": 4 * numel, "s": seconds}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        measure(args.calls)
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from cona.planner.systems import load_system

    prior = load_system("cpu_gloo").intra_node.latency_s
    print(f"cpu_gloo prior: {prior * 1e6:.0f} us a hop; cores here: {len(os.sched_getaffinity(0))}")
    for world in (int(size) for size in args.world_sizes.split(",")):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   os.path.abspath(__file__), "--worker", "--calls", str(args.calls)]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        if done.returncode != 0:
            sys.exit(f"torchrun --nproc-per-node={world} failed: {done.stderr[-2000:]}")
        for line in done.stdout.splitlines():
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            hop = row["s"] / (2 * (row["world"] - 1))
            print(
                f"world {row['world']}  {row['bytes']:>9,} B  {row['s'] * 1e3:7.3f} ms a call  "
                f"{hop * 1e6:7.0f} us a hop  {hop / prior:6.1f}x the prior"
            )


if __name__ == "__main__":
    main()
