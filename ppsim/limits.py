"""Bounded work: estimate what a command will do before doing it, and refuse beyond documented limits.

Every command should finish within about 10 s and 2 GB on a laptop unless the user asks for more. The limits
below are sized for that (the simulator replays about 0.5-1 M actions/s and holds about 300 bytes per action; a CSV
is also parsed and validated, about 10 us per action, hence its lower limit);
the perf target ``simulate -s Interleaved1F1B -r 128 -m 1024 -v 4`` (about 1 M actions) runs without an override.
A refusal names the estimate, the limit and the override (``--allow-large`` on the command line,
``allow_large=True`` in the library).

| limit | value | applies to |
|---|---|---|
| :data:`MAX_ACTIONS` | 2,000,000 computations | building, validating, simulating, exporting a schedule |
| :data:`MAX_RANKS` | 2,048 ranks | every schedule |
| :data:`MAX_FILE_ACTIONS` | 500,000 computations | a schedule CSV (it is parsed and validated too) |
| :data:`MAX_FILE_BYTES` | 16 MiB | a schedule CSV read from disk |
| :data:`MAX_TIMELINE_ACTIONS` | 200,000 actions | ``export --format json`` / ``chrome`` (~140 / 420 bytes per action) |
| :data:`MAX_FIGURE_ACTIONS` | 50,000 computations | ``plot`` and each schedule in ``report`` |
| :data:`MAX_FIGURE_RANKS` | 1,000 ranks | ``plot`` and ``report`` |
| :data:`MAX_COMPARE_ACTIONS` | 2,000,000 computations | all schedules of one ``simulate -s A,B,...`` together |
| :data:`MAX_REPORT_ACTIONS` | 100,000 computations | all figures of one ``report`` together |
| :data:`MAX_REPORT_RANKS` | 2,000 rows | all figures of one ``report`` together |
| :data:`MAX_SEARCH_ACTIONS` | 100,000 computations per order | ``search`` (thousands of orders built and simulated) |
| set-up within ``--time-limit`` | :func:`estimate_search` | ``search``: timing the named schedules and a first order |
| :data:`MAX_RUN_ACTIONS` | 100,000 actions | one step of ``ppsim run`` (every action runs and is timed) |
| :data:`MAX_RUN_STEPS` / :data:`MAX_RUN_EXECUTED` | 1,000 steps / 1M actions | all the steps of one ``run`` |
| :data:`MAX_REAL_RANKS_PER_CORE` / :data:`MAX_SYNTHETIC_RANKS` | 4 per core / 64 | local rank processes of ``run`` |
| :data:`MAX_CALIBRATION_S` | 1 h (estimated) | one ``calibrate``, the runtime probe of the whole model included |
| :data:`MAX_TIMEOUT_S` | 7 days | ``run --timeout``, ``calibrate --init-timeout`` (not liftable) |
| :data:`MAX_MODEL_DIM` | 2**31 - 1 | each model size (hidden, layers, ...; not liftable) |
| :data:`MAX_MODEL_LAYERS` | 1,000,000 | a model's layers (ppsim keeps an entry per layer; not liftable) |
| :data:`MAX_COST` / :data:`MIN_COST` | 1e12 / 1e-12 | one op's time in ``--costs`` (0 allowed; not liftable) |
| :data:`MAX_STAGES` | 100,000 | a count in ``--split``, ``--layers-per-stage`` (not liftable) |
| :data:`MAX_PROFILE_BYTES` | 64 MiB | a profile file read (not liftable) |
| :data:`MAX_SLEEP_S` | 1 h | one synthetic computation of ``run --synthetic`` (not liftable) |
"""

from __future__ import annotations

from dataclasses import dataclass

from ppsim.errors import PPSimError
from ppsim.io import fmt_bytes

MAX_ACTIONS = 2_000_000
MAX_RANKS = 2_048
MAX_FILE_ACTIONS = 500_000
MAX_FILE_BYTES = 16 * 2**20
MAX_TIMELINE_ACTIONS = 200_000
MAX_FIGURE_ACTIONS = 50_000
MAX_FIGURE_RANKS = 1_000

MAX_COMPARE_ACTIONS = MAX_ACTIONS
MAX_REPORT_ACTIONS = 2 * MAX_FIGURE_ACTIONS
MAX_REPORT_RANKS = 2 * MAX_FIGURE_RANKS

MAX_SEARCH_ACTIONS = 100_000
"""Largest order ``ppsim search`` takes without ``--allow-large`` (about 20 ms per simulation)."""
SEARCH_PASS_SECONDS = 1.5e-7
"""One list-scheduling pass of the search takes about this x R^2.5 x M x v^2.3 seconds (a rank waiting for its
inputs may rescan the others; measured on 2 loaded cores, M=16, one stage per rank: R=64 0.07 s, R=128 0.35 s,
R=256 2.1 s; V placement 4-5x)."""
MAX_RUN_ACTIONS = 100_000
MAX_RUN_STEPS = 1_000
MAX_RUN_EXECUTED = 1_000_000
MAX_REAL_RANKS_PER_CORE = 4
MAX_SYNTHETIC_RANKS = 64
MEMORY_SHARE = 0.8
"""Share of the available memory a run or a calibration may plan to use."""
MAX_CALIBRATION_S = 3600.0
MAX_TIMEOUT_S = 7 * 86_400.0
"""Longest timeout a command takes: beyond it, thread waits overflow (no override: nothing needs longer)."""
MAX_MODEL_DIM = 2**31 - 1
MAX_MODEL_LAYERS = 1_000_000
"""Layers of one model: the largest models have hundreds; ppsim keeps a kind, a block name and a split entry per
layer, so a billion would end in ``MemoryError`` whatever ``--allow-large`` lifts."""
"""Largest model size (torch's index range; no override: nothing larger can be built)."""
MAX_COST = 1e12
"""Largest time one op (or ``comm``) may take in a cost string: a step sums millions of them, and beyond this
results lose precision and eventually overflow to inf/NaN."""
MIN_COST = 1e-12
"""Smallest non-zero time per op in a cost string (any unit): 24 orders of magnitude between the two limits."""
MAX_STAGES = 100_000
"""Largest count in a split given on the command line (far beyond any real pipeline)."""
MAX_PROFILE_BYTES = 64 * 1024 * 1024
"""Largest profile file read (a tiny-model profile with 20 samples per timing is a few tens of kB)."""
MAX_SLEEP_S = 3600.0
"""The longest a single synthetic computation may sleep (seconds); longer costs are a user error, not a hang."""

BYTES_PER_ACTION = 300
"""Memory the simulator holds per action (schedule, timeline, result), measured on the perf target."""
ACTIONS_PER_SECOND = 500_000
"""Conservative throughput of build + simulate, for the time in a refusal message."""

OVERRIDE_FLAG = "--allow-large"

# Computations per (stage, microbatch): F + B, or F + I + W for schedules that split the backward.
_SPLIT_BACKWARD = frozenset({"interleavedzerobubble", "zbvzerobubble", "dualpipev", "dualpipe", "zbh1", "zbh2"})
_TWO_PIPELINES = frozenset({"dualpipe"})


class WorkLimitError(PPSimError):
    """The requested work exceeds a documented limit (the message names the estimate, the limit and the override)."""


@dataclass(frozen=True)
class WorkEstimate:
    """What a schedule will cost to handle, known before it is built."""

    what: str
    num_ranks: int
    num_actions: int

    @property
    def num_bytes(self) -> int:
        return self.num_actions * BYTES_PER_ACTION

    @property
    def seconds(self) -> float:
        return self.num_actions / ACTIONS_PER_SECOND

    def describe(self) -> str:
        return (
            f"{self.what}: about {self.num_actions:,} actions on {self.num_ranks:,} ranks "
            f"(~{fmt_bytes(self.num_bytes)}, ~{_fmt_seconds(self.seconds)})"
        )


def estimate_named(name: str, num_ranks: int, num_microbatches: int, num_stages_per_rank: int) -> WorkEstimate:
    """Upper-bound estimate for a registry schedule: ranks x stages per rank x microbatches per chain x ops."""
    key = name.lower()
    ops = 3 if key in _SPLIT_BACKWARD or not _is_known(key) else 2
    chains = 2 if key in _TWO_PIPELINES else 1
    per_chain = -(-max(num_microbatches, 0) // chains)
    actions = max(num_ranks, 0) * max(num_stages_per_rank, 1) * per_chain * ops
    return WorkEstimate(f"{name} -r {num_ranks} -m {num_microbatches} -v {num_stages_per_rank}", num_ranks, actions)


def check_work(estimate: WorkEstimate, *, allow_large: bool = False, max_actions: int = MAX_ACTIONS) -> None:
    """Refuse (:class:`WorkLimitError`) an estimate beyond ``max_actions`` or :data:`MAX_RANKS`."""
    if allow_large:
        return
    if estimate.num_ranks > MAX_RANKS:
        raise WorkLimitError(
            f"{estimate.describe()}: more than the limit of {MAX_RANKS:,} ranks; use fewer ranks, or pass "
            f"{OVERRIDE_FLAG} to run it anyway"
        )
    if estimate.num_actions > max_actions:
        raise WorkLimitError(
            f"{estimate.describe()}: more than the limit of {max_actions:,} actions; use fewer ranks or "
            f"microbatches, or pass {OVERRIDE_FLAG} to run it anyway"
        )


@dataclass(frozen=True)
class SearchEstimate:
    """What a search's set-up costs, known before it starts: one order's actions (all placements together) and the
    seconds to time the named schedules and list-schedule a first order."""

    what: str
    num_ranks: int
    num_actions: int
    setup_seconds: float


def estimate_search(
    num_ranks: int, num_microbatches: int, stages_per_rank: tuple[int, ...], *, num_named: int
) -> SearchEstimate:
    """``stages_per_rank``: one entry per placement searched (1..v for loop, 2 for V)."""
    R, M = max(num_ranks, 0), max(num_microbatches, 0)
    actions = sum(R * v * M * 3 for v in stages_per_rank)
    first_pass = sum(SEARCH_PASS_SECONDS * R**2.5 * M * v**2.3 for v in stages_per_rank)
    named = num_named * actions / ACTIONS_PER_SECOND
    what = f"search -r {num_ranks} -m {num_microbatches}"
    return SearchEstimate(what, R, actions, first_pass + named)


def check_search(estimate: SearchEstimate, *, time_limit: float, allow_large: bool = False) -> None:
    """Refuse a search whose orders exceed :data:`MAX_SEARCH_ACTIONS` or whose set-up cannot fit ``time_limit``."""
    check_work(WorkEstimate(estimate.what, estimate.num_ranks, estimate.num_actions), allow_large=allow_large,
               max_actions=MAX_SEARCH_ACTIONS)
    if allow_large or estimate.setup_seconds <= time_limit:
        return
    raise WorkLimitError(
        f"{estimate.what}: about {estimate.num_actions:,} actions per order; timing the named schedules and a first "
        f"order alone takes ~{_fmt_seconds(estimate.setup_seconds)}, more than --time-limit {time_limit:g}; raise "
        f"--time-limit to {max(1, round(estimate.setup_seconds + 0.5))} or more, use fewer ranks or microbatches, "
        f"or pass {OVERRIDE_FLAG} to run it anyway"
    )


def check_figure(what: str, num_ranks: int, num_actions: int, *, allow_large: bool = False) -> None:
    """Refuse a figure with more than :data:`MAX_FIGURE_ACTIONS` boxes or :data:`MAX_FIGURE_RANKS` rows."""
    if allow_large:
        return
    if num_ranks > MAX_FIGURE_RANKS or num_actions > MAX_FIGURE_ACTIONS:
        raise WorkLimitError(
            f"{what}: a figure of {num_actions:,} actions on {num_ranks:,} ranks is beyond the drawing limit of "
            f"{MAX_FIGURE_ACTIONS:,} actions and {MAX_FIGURE_RANKS:,} ranks (it would take minutes and gigabytes); "
            f"use `ppsim simulate` or `export --format chrome` for big schedules, fewer ranks/microbatches, or pass "
            f"{OVERRIDE_FLAG} to draw it anyway"
        )


def check_total(what: str, num_ranks: int, num_actions: int, *, max_actions: int, max_ranks: int | None = None,
                allow_large: bool = False) -> None:
    """Refuse a comparison whose schedules together exceed ``max_actions`` computations (or ``max_ranks`` rows)."""
    if allow_large:
        return
    if num_actions > max_actions or (max_ranks is not None and num_ranks > max_ranks):
        rows, limit = ("", "") if max_ranks is None else (f" in {num_ranks:,} rows", f" and {max_ranks:,} rows")
        raise WorkLimitError(
            f"{what}: {num_actions:,} actions{rows} in all, beyond the limit of {max_actions:,} "
            f"actions{limit} for one command (~{fmt_bytes(num_actions * BYTES_PER_ACTION)}); compare fewer schedules "
            f"or use fewer ranks or microbatches, or pass {OVERRIDE_FLAG} to run it anyway"
        )


_TIMELINE_BYTES_PER_ACTION = {"json": 140, "chrome": 420}


def check_timeline(what: str, num_actions: int, *, fmt: str, allow_large: bool = False) -> None:
    """Refuse a timed export (JSON timeline, Chrome trace) of more than :data:`MAX_TIMELINE_ACTIONS` actions."""
    if allow_large or num_actions <= MAX_TIMELINE_ACTIONS:
        return
    size = fmt_bytes(num_actions * _TIMELINE_BYTES_PER_ACTION.get(fmt, 420))
    raise WorkLimitError(
        f"{what}: a {fmt} timeline of {num_actions:,} actions (~{size} to write) is beyond the limit of "
        f"{MAX_TIMELINE_ACTIONS:,} actions; export --format csv (the order, small), use fewer ranks or microbatches, "
        f"or pass {OVERRIDE_FLAG} to write it anyway"
    )


def check_file_size(path: str, num_bytes: int, *, allow_large: bool = False) -> None:
    """Refuse a schedule file larger than :data:`MAX_FILE_BYTES` before reading it."""
    if allow_large or num_bytes <= MAX_FILE_BYTES:
        return
    raise WorkLimitError(
        f"schedule file {path!r} is {fmt_bytes(num_bytes)}, more than the limit of {fmt_bytes(MAX_FILE_BYTES)} "
        f"(about {MAX_FILE_ACTIONS:,} actions); pass a smaller file, or {OVERRIDE_FLAG} to read it anyway"
    )


def check_run_steps(what: str, *, num_actions: int, num_steps: int, allow_large: bool = False) -> None:
    """Refuse a ``ppsim run`` of more than :data:`MAX_RUN_STEPS` steps or :data:`MAX_RUN_EXECUTED` executed
    actions (``num_actions`` per step, ``num_steps`` warm-up, timed and probe steps together)."""
    if allow_large:
        return
    executed = num_actions * num_steps
    if num_steps > MAX_RUN_STEPS or executed > MAX_RUN_EXECUTED:
        raise WorkLimitError(
            f"{what}: {num_steps:,} steps of {num_actions:,} actions, about {executed:,} executed and timed actions, "
            f"beyond the limit of {MAX_RUN_STEPS:,} steps and {MAX_RUN_EXECUTED:,} actions; use fewer --steps, "
            f"--warmup or --probes, or pass {OVERRIDE_FLAG} to run it anyway"
        )


def check_timeout(option: str, seconds: float, *, least: float) -> float:
    """``seconds`` if it is a finite number of seconds in ``[least, MAX_TIMEOUT_S]``; else a one-line refusal."""
    if not (isinstance(seconds, (int, float)) and least <= seconds <= MAX_TIMEOUT_S):  # also refuses NaN
        raise PPSimError(
            f"{option} {seconds}: must be a number of seconds from {least:g} to {MAX_TIMEOUT_S:,.0f} (7 days); "
            f"e.g. {option} 600"
        )
    return float(seconds)


def run_memory_bytes(*, num_ranks: int, num_microbatches: int, weight_bytes: int, microbatch_bytes: int,
                     whole_model_bytes: int = 0) -> int:
    """A generous estimate of what a local ``ppsim run`` (or calibrate's runtime probe) holds: per rank the torch
    runtime (~300 MiB) and ``whole_model_bytes`` (a model built whole before it is cut), weights and gradients of
    the stages, activations of every microbatch; plus the non-pipelined reference on rank 0. The sizes come from
    the model source (``ModelSource.run_bytes``)."""
    runtime = 300 << 20
    return (num_ranks * (runtime + whole_model_bytes) + 2 * (2 * weight_bytes)
            + 2 * num_microbatches * microbatch_bytes)


def _is_known(key: str) -> bool:
    return key in _SPLIT_BACKWARD or key in {"gpipe", "afab", "1f1b", "interleaved1f1b", "loopedbfs"}


def _fmt_seconds(s: float) -> str:
    if s < 1:
        return "<1 s"
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    if s < 86400 * 2:
        return f"{s / 3600:.0f} h"
    return f"{s / 86400:,.0f} days"
