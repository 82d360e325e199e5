"""Options shared by several commands, each declared once as an ``Annotated`` type.

An option used by several commands is one type here; a command takes it as ``name: XOpt = default``.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from ppsim.compare import CostScope
from ppsim.io import output_file

JOB_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}
"""``context_settings`` of the commands that take --torchtitan-config (simulate, plot, report, calibrate, run): the
job config's overrides (``--parallelism.KEY VALUE``) arrive as extra arguments, as on torchtitan's own command
line; :func:`ppsim.job.overrides.extra_overrides` sorts them out."""


__all__ = ["output_file"]  # the parser of every output-file option (-o, --plot, --profile-out)


ScheduleOpt = Annotated[
    list[str],
    typer.Option("--schedule", "-s", help="Schedule name (case-insensitive, see `ppsim list`) or a .csv file."),
]
"""One schedule; a list only so that a repeated -s is an error instead of silently keeping the last."""
SchedulesOpt = Annotated[
    list[str],
    typer.Option("--schedule", "-s", help="One schedule, or several: A,B,C or -s A -s B."),
]
MaybeScheduleOpt = Annotated[
    Optional[list[str]],
    typer.Option("--schedule", "-s", help="Schedule name (case-insensitive, see `ppsim list`) or a .csv file "
                 "(optional with --torchtitan-config)."),
]
MaybeSchedulesOpt = Annotated[
    Optional[list[str]],
    typer.Option("--schedule", "-s", help="One schedule, or several: A,B,C or -s A -s B; optional with "
                 "--torchtitan-config."),
]
RanksOpt = Annotated[Optional[int], typer.Option("--ranks", "-r", help="Pipeline ranks (devices).")]
MbOpt = Annotated[Optional[int], typer.Option("--mb", "-m", help="Microbatches per step.")]
VOpt = Annotated[
    Optional[int],
    typer.Option("--stages-per-rank", "-v", help="Virtual stages per rank (interleaved/looped schedules; default 2)."),
]
DirectionsOpt = Annotated[
    Optional[int],
    typer.Option(
        "--directions",
        help="For .csv files: independent pipelines the stages form (2 for DualPipe files, see formulas.md).",
        min=1,
        max=2,
    ),
]
CostsOpt = Annotated[
    Optional[str],
    typer.Option("--costs", help='Per-op times in one unit, e.g. "F=1,B=2,I=1,W=1,FB=2.5,comm=0.1".'),
]
ProfileOpt = Annotated[
    Optional[Path], typer.Option("--profile", help="Profile JSON from `ppsim calibrate` (replaces --costs).")
]
SplitOpt = Annotated[
    Optional[str],
    typer.Option("--split", metavar="N,N,...", help="Layers per stage of one chain for a per-block profile, e.g. "
                 "3,4,4,3 (default: torchtitan's even spread, embedding and head weighing one layer each)."),
]
LayersPerStageOpt = Annotated[
    Optional[int],
    typer.Option("--layers-per-stage", min=1, help="Layers per stage as torchtitan's "
                 "pipeline_parallel_layers_per_stage: stages = ceil((layers + 2) / K), which must be the "
                 "schedule's chain length (per-block profile)."),
]
TorchtitanConfigOpt = Annotated[
    Optional[str],
    typer.Option("--torchtitan-config", metavar="MODULE:CONFIG|TOML",
                 help="torchtitan job config: a config function of torchtitan's registry (e.g. "
                 "llama3:llama3_debugmodel; needs the torchtitan extra) or an older release's job TOML. simulate, "
                 "plot, report: the pipeline it would run; calibrate: its model, training.seq_len and "
                 "pipeline_parallel_microbatch_size; run: all of these. Override its keys as torchtitan does: "
                 "--parallelism.KEY VALUE, --training.KEY VALUE."),
]
MemCapOpt = Annotated[
    Optional[str], typer.Option("--memory-cap", help="Flag ranks whose peak memory exceeds CAP per rank: bytes "
                                "(80GB = 80e9, 80GiB = 80*2^30) or activations (8act).")
]
AllocatorOpt = Annotated[str, typer.Option(
    "--allocator",
    help="With --torchtitan-config: replay the CUDA caching allocator with expandable (torchtitan's "
    "PYTORCH_CUDA_ALLOC_CONF) or default segments; --memory-cap then judges its reserved peak plus the CUDA context "
    "and NCCL's buffers; none: no replay, the tensors' peak alone.")]
CostScopeOpt = Annotated[
    Optional[CostScope],
    typer.Option(
        "--cost-scope",
        case_sensitive=False,
        help="What --costs times describe: one stage chunk or one rank's share of the model. Default: per chunk, "
        "except that schedules with different stage counts are compared per rank share (the same model).",
    ),
]
RecomputeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--recompute",
        metavar="none|full|auto|FILE.json",
        help="Activation recomputation. simulate/plot/report: none, full (every stage and microbatch keeps only its "
        "boundary input after F and runs F again before its backward) or a set written by `ppsim search "
        "--recompute auto` (default: none, or for -s FILE.csv the FILE.recompute.json beside it when present). "
        "search: none or auto (choose per stage and microbatch what to recompute to meet --memory-cap).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
AllowLargeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-large",
        help="Go beyond ppsim's size limits (2M actions, 2048 ranks; CSV files 500k actions, 16 MiB; json/chrome "
        "exports 200k actions; figures 50k actions, 1000 ranks), which can take minutes and gigabytes.",
    ),
]


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


# --- the model `calibrate` measures and `run` executes (ppsim.calibrate.models) -----------------------------------
ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", metavar="SOURCE", help="builtin:NAME (tiny, 1b, 8b), torchtitan:FAMILY/FLAVOR (e.g. "
                 "torchtitan:llama3/debugmodel) or python:PKG.MODULE:FACTORY. Default: builtin:tiny (run with "
                 "--profile: the profile's model)."),
]
PresetOpt = Annotated[Optional[str], typer.Option("--preset", help="Alias of --model builtin:NAME: tiny, 1b, 8b.")]
HiddenOpt = Annotated[Optional[int], typer.Option("--hidden", help="Hidden size (overrides the preset).")]
HeadsOpt = Annotated[Optional[int], typer.Option("--heads", help="Attention heads; must divide --hidden.")]
FfnOpt = Annotated[Optional[int], typer.Option("--ffn", help="SwiGLU inner size.")]
LayersOpt = Annotated[
    Optional[int],
    typer.Option("--layers", help="Layers in the whole model (any --model; torchtitan: the flavor's layers "
                 "truncated, or extended with its last layer's kind)."),
]
VocabOpt = Annotated[Optional[int], typer.Option("--vocab", help="Vocabulary size.")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per sequence.")]
MbSizeOpt = Annotated[Optional[int], typer.Option("--mb-size", help="Sequences per microbatch.")]
DTypeOpt = Annotated[Optional[DType], typer.Option("--dtype", case_sensitive=False,
                                                    help="float32, bfloat16 or float16.")]


class ExportFormat(str, Enum):
    csv = "csv"
    json = "json"
    chrome = "chrome"
ClusterOpt = Annotated[
    Optional[str],
    typer.Option("--cluster", help="cluster preset or file (TOML/JSON): nodes, GPUs per node, links, NICs, device; "
                 "`ppsim list --clusters`"),
]
