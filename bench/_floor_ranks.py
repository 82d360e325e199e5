"""One torchrun rank of ``bench_cluster.py floor``: the median time of a gloo all_reduce of each size over the whole
world (barrier-aligned, after warm-ups), printed by rank 0 as one JSON line ``{"floor": {bytes: seconds}}``."""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20)
REPS, WARMUP = 30, 5


def main() -> None:
    dist.init_process_group("gloo")
    got = {}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        for _ in range(WARMUP):
            dist.all_reduce(x)
        times = []
        for _ in range(REPS):
            dist.barrier()
            begun = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - begun)
        got[nbytes] = statistics.median(times)
    if dist.get_rank() == 0:
        print(json.dumps({"floor": got}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
