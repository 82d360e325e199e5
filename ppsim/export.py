"""Writers for a simulated timeline: ppsim's timed JSON and a Chrome/Perfetto trace.

Both read only the :class:`~ppsim.result.SimResult` and write atomically (temporary file + rename).

Chrome trace layout (load in ui.perfetto.dev or chrome://tracing): one process per rank (``pid`` = rank), thread 0
is the compute lane, threads 1.. are comm lanes named after the peer (``send to rank 3``, and ``#2``, ``#3`` when
hand-offs to that peer overlap in time, since sends do not serialise). Every computation is an ``X`` event (a pair's
halves are two events, forward half first); every rank-crossing hand-off with a nonzero delay is an ``X`` event on a
comm lane of the sender; flow arrows (``s``/``f`` with ``bp: "e"``) join each producer to its consumer on the other
rank. Times are microseconds rounded to the nanosecond: profile seconds x 1e6, cost-string units x 1000 (one unit
is drawn as one millisecond).
"""

from __future__ import annotations

import heapq
import json
import os
from itertools import chain
from pathlib import Path
from typing import Any

from ppsim.io import write_atomic
from ppsim.result import COMP_TYPES, SimResult, stage_tables

US_PER_UNIT = {"s": 1e6, "unit": 1e3}
_COMPUTE_TID = 0


def timeline_dict(result: SimResult) -> dict[str, Any]:
    """The JSON timeline: schedule metadata, summary, and every action with its start and end."""
    s = result.schedule
    t = result.trace
    summary = result.to_dict()
    flat = list(chain.from_iterable(s.actions))
    lengths = [len(row) for row in s.actions]
    ranks = [r for r, k in enumerate(lengths) for _ in range(k)]
    positions = [p for k in lengths for p in range(k)]
    actions: list[dict[str, Any]] = [
        {
            "rank": rank,
            "position": position,
            "action": f"{a.stage}{a.type.value}{'' if a.microbatch is None else a.microbatch}",
            "type": a.type.value,
            "start": start,
            "end": end,
            "stage": a.stage,
            "microbatch": a.microbatch,
        }
        for rank, position, a, start, end in zip(ranks, positions, flat, t.start.tolist(), t.end.tolist())
    ]
    if len(t.pair_first):  # overlapped pairs: their halves instead of a stage and a microbatch
        c_stage, c_type, c_mb = t.comp_stage.tolist(), t.comp_type.tolist(), t.comp_mb.tolist()
        h_start, h_end = t.comp_half_start.tolist(), t.comp_half_end.tolist()
        for first, a in zip(t.pair_first.tolist(), t.comp_owner[t.pair_first].tolist()):
            entry = actions[a]
            actions[a] = {key: entry[key] for key in ("rank", "position")}
            actions[a].update(action=str(flat[a]), type=entry["type"], start=entry["start"], end=entry["end"])
            actions[a]["halves"] = [
                {
                    "action": f"{c_stage[c]}{COMP_TYPES[c_type[c]]}{c_mb[c]}",
                    "type": COMP_TYPES[c_type[c]],
                    "stage": c_stage[c],
                    "microbatch": c_mb[c],
                    "start": h_start[c],
                    "end": h_end[c],
                }
                for c in (first, first + 1)
            ]
    return {
        "schema": "ppsim.timeline",
        "version": 1,
        **{k: v for k, v in summary.items() if k not in ("costs", "per_rank")},
        "unit": result.unit,
        "stage_to_rank": list(s.stage_to_rank),
        "pipelines": [list(chain_) for chain_ in s.pipelines],
        "throughput": result.throughput,
        "per_rank": summary["per_rank"],
        "costs": summary["costs"],
        "actions": actions,
    }


def write_json_timeline(result: SimResult, path: str | os.PathLike[str]) -> Path:
    """Write :func:`timeline_dict` as JSON (atomically); returns the path."""
    return write_atomic(path, json.dumps(timeline_dict(result), allow_nan=False) + "\n")


def chrome_trace(result: SimResult) -> dict[str, Any]:
    """The Chrome/Perfetto trace object (``traceEvents`` plus ``otherData``)."""
    s = result.schedule
    t = result.trace
    scale_ns = US_PER_UNIT.get(result.unit, 1e3) * 1000.0

    def ns(x: float) -> int:
        return round(x * scale_ns)

    def us(x_ns: int) -> float:
        return x_ns / 1000.0

    events: list[dict[str, Any]] = []
    for rank in range(s.num_ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": _COMPUTE_TID, "args": {"name": "compute"}})

    chunk_of, direction_of = stage_tables(s)
    offsets = t.offsets.tolist()
    c_owner = t.comp_owner.tolist()
    c_stage = t.comp_stage.tolist()
    c_type = t.comp_type.tolist()
    c_mb = t.comp_mb.tolist()
    h_start = [ns(x) for x in t.comp_half_start.tolist()]
    h_end = [ns(x) for x in t.comp_half_end.tolist()]
    rank_of_action: list[int] = []
    for rank in range(s.num_ranks):
        rank_of_action.extend([rank] * (offsets[rank + 1] - offsets[rank]))
    is_pair = [False] * len(c_owner)
    for c in range(1, len(c_owner)):
        if c_owner[c] == c_owner[c - 1]:
            is_pair[c] = is_pair[c - 1] = True
    names = [f"{c_stage[c]}{COMP_TYPES[c_type[c]]}{c_mb[c]}" for c in range(len(c_owner))]
    for c, a in enumerate(c_owner):
        rank = rank_of_action[a]
        args: dict[str, Any] = {
            "stage": c_stage[c],
            "microbatch": c_mb[c],
            "chunk": int(chunk_of[c_stage[c]]),
            "direction": int(direction_of[c_stage[c]]),
            "position": a - offsets[rank],
        }
        if is_pair[c]:
            args["pair"] = str(s.actions[rank][a - offsets[rank]])
        events.append({
            "ph": "X", "name": names[c], "cat": COMP_TYPES[c_type[c]], "pid": rank, "tid": _COMPUTE_TID,
            "ts": us(h_start[c]), "dur": us(h_end[c] - h_start[c]), "args": args,
        })

    prod, cons, send_at, arrive_at, nbytes = t.transfers
    hops = []
    for k, (p, q, send, arrive, b) in enumerate(
        zip(prod.tolist(), cons.tolist(), send_at.tolist(), arrive_at.tolist(), nbytes.tolist())
    ):
        src, dst = rank_of_action[c_owner[p]], rank_of_action[c_owner[q]]
        hops.append((src, dst, ns(send), ns(arrive), p, q, b, k))
    timed = [h for h in hops if h[3] > h[2]]
    lane_names: dict[tuple[int, int], str] = {}
    for (src, dst, send, arrive, p, q, b, _), (tid, name) in zip(timed, _comm_lanes(timed)):
        lane_names[(src, tid)] = name
        events.append({
            "ph": "X", "name": f"{names[p]} -> {names[q]}", "cat": "comm", "pid": src, "tid": tid,
            "ts": us(send), "dur": us(arrive - send),
            "args": {"kind": "F" if c_type[p] == 0 else "B", "dst_rank": dst, "bytes": None if b != b else int(b)},
        })
    for src, dst, _, _, p, q, _, k in hops:
        # flow arrow: from inside the producer's slice to inside the consumer's slice
        s_ts = max(h_start[p], h_end[p] - 1)
        f_ts = min(h_start[q] + 1, h_end[q])
        events.append({"ph": "s", "id": k, "name": "hand-off", "cat": "flow", "pid": src, "tid": _COMPUTE_TID,
                       "ts": us(s_ts)})
        events.append({"ph": "f", "bp": "e", "id": k, "name": "hand-off", "cat": "flow", "pid": dst,
                       "tid": _COMPUTE_TID, "ts": us(f_ts)})
    for (src, tid), name in sorted(lane_names.items()):
        events.append({"ph": "M", "name": "thread_name", "pid": src, "tid": tid, "args": {"name": name}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": s.name,
            "ranks": s.num_ranks,
            "microbatches": s.num_microbatches,
            "unit": result.unit,
            "us_per_unit": US_PER_UNIT.get(result.unit, 1e3),
            "makespan": result.makespan,
        },
    }


def write_chrome_trace(result: SimResult, path: str | os.PathLike[str]) -> Path:
    """Write :func:`chrome_trace` as JSON (atomically); returns the path."""
    return write_atomic(path, json.dumps(chrome_trace(result), allow_nan=False) + "\n")


def _comm_lanes(hops: list[tuple[Any, ...]]) -> list[tuple[int, str]]:
    """A comm lane (tid, name) per hop: per (sender, receiver) the fewest lanes in which no two hops overlap."""
    order = sorted(range(len(hops)), key=lambda k: (hops[k][0], hops[k][1], hops[k][2], hops[k][3]))
    assigned: dict[int, tuple[int, int, int]] = {}  # hop -> (src, dst, sub-lane)
    free: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (src, dst) -> heap of (busy until, sub-lane)
    count: dict[tuple[int, int], int] = {}
    for k in order:
        src, dst, send, arrive = hops[k][:4]
        heap = free.setdefault((src, dst), [])
        if heap and heap[0][0] <= send:
            _, sub = heapq.heappop(heap)
        else:
            sub = count.get((src, dst), 0)
            count[(src, dst)] = sub + 1
        heapq.heappush(heap, (arrive, sub))
        assigned[k] = (src, dst, sub)
    tids: dict[tuple[int, int, int], int] = {}
    next_tid: dict[int, int] = {}
    for src, dst, sub in sorted(set(assigned.values())):
        next_tid[src] = next_tid.get(src, _COMPUTE_TID) + 1
        tids[(src, dst, sub)] = next_tid[src]
    out = []
    for k in range(len(hops)):
        src, dst, sub = assigned[k]
        name = f"send to rank {dst}" + (f" #{sub + 1}" if sub else "")
        out.append((tids[(src, dst, sub)], name))
    return out
