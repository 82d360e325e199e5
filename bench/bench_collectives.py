"""The collective model against nccl-tests' published HGX H100 figures: one row per figure, with the model's bus
bandwidth, the error against the published range, and the `ppsim collective` command that prints it.

    python bench/bench_collectives.py
"""

from __future__ import annotations

from ppsim.step.cluster import load_cluster
from ppsim.step.collectives import Span, predict
from ppsim.step.kinds import CollectiveKind

GiB = 1 << 30

ROWS = [
    # (what, op, ranks, nodes, bytes, size text, published low, high (GB/s bus bandwidth), where published)
    ("AG intra-node", "all_gather", 8, 1, GiB, "1GiB", 360, 370, "nccl-tests issues 326, 212, 290, 267"),
    ("RS intra-node", "reduce_scatter", 8, 1, GiB, "1GiB", 360, 370, "nccl-tests issues 326, 212, 290, 267"),
    ("AR intra-node (NVLS)", "all_reduce", 8, 1, 8 * GiB, "8GiB", 470, 490, "NVIDIA HGX H100 NVLS all_reduce"),
    ("AG 2 nodes, 8 NICs", "all_gather", 16, 2, 16 * GiB, "16GiB", 8 * 46, 8 * 49, "46-49 GB/s per 400 Gb/s NIC"),
    ("AG 16 nodes, 8 NICs", "all_gather", 128, 16, 16 * GiB, "16GiB", 8 * 46, 8 * 49, "46-49 GB/s per 400 Gb/s NIC"),
    ("AG 2 nodes, 1 rank/node", "all_gather", 2, 2, 16 * GiB, "16GiB", 46, 49, "46-49 GB/s per 400 Gb/s NIC"),
    ("all-to-all 16 nodes", "all_to_all", 128, 16, 16 * GiB, "16GiB", 46, 49, "about one NIC per GPU"),
]


def error(value: float, low: float, high: float) -> float:
    """Relative error against the published range (0 inside it)."""
    if value < low:
        return value / low - 1
    if value > high:
        return value / high - 1
    return 0.0


def main() -> None:
    cluster = load_cluster("h100")
    print("| figure | published busbw GB/s | model busbw GB/s | error | choice | command |")
    print("|---|---|---|---|---|---|")
    for what, op, ranks, nodes, nbytes, text, low, high, where in ROWS:
        p = predict(CollectiveKind(op), nbytes, Span(ranks, nodes), cluster)
        value = p.busbw_Bps / 1e9
        command = f"ppsim collective --op {op} --ranks {ranks} --nodes {nodes} --size {text} --cluster h100"
        print(f"| {what} | {low:g}-{high:g} ({where}) | {value:.1f} | {error(value, low, high):+.1%} | "
              f"{p.algorithm}/{p.protocol} | `{command}` |")


if __name__ == "__main__":
    main()
