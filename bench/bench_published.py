"""Published runs at scale against ppsim's prediction (docs/scale.md): each figure, the command or computation that
made it, the published number and the error. Deterministic: every number comes from committed profiles, the
layer-cost rules of bench/published_profiles.py and the cluster presets (no timing).

    python bench/bench_published.py [--out DIR] [--write-test-data]

1. torchtitan, Llama 3.1 8B, FSDP 8 (one node) -> FSDP 128 (16 nodes), local batch 2, seq 8192, selective AC:
   5,762 -> 5,605 tokens/s/GPU (benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3).
2. Llama 3 405B, TP 8 x PP 16 x DP 64 (8,192 GPUs, batch 32 per DP) -> DP 128 (16,384 GPUs, batch 16 per DP):
   430 -> 400 TFLOP/s per GPU ("The Llama 3 Herd of Models", table 4).
3. DeepSeek-V3 671B, PP 16 (DualPipe) x EP 64 on 2,048 H800s: cross-node all-to-all about 1:1 with computation
   (technical report, sec. 3.2.1); 180K H800 GPU hours per trillion tokens, about 1,543 tokens/s per GPU.

``--write-test-data`` also writes the two derived Llama profiles the suite's test reads
(tests/data/llama3_8b_from70b_h100_s8192_mb2_sac.profile.json, tests/data/llama3_405b_h100_s8192_tp8.profile.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_profiles import LLAMA3, deepseek_from_flops, derive_llama  # noqa: E402

from ppsim.profile import load_profile, save_profile  # noqa: E402

PROFILE_70B = ROOT / "docs/data/llama3_70b_h100_s8192.profile.json"
PROFILE_405B = ROOT / "docs/data/llama3_405b_h100_s8192.profile.json"
TEST_8B = ROOT / "tests/data/llama3_8b_from70b_h100_s8192_mb2_sac.profile.json"
TEST_405B = ROOT / "tests/data/llama3_405b_h100_s8192_tp8.profile.json"
SEQ = 8192
H800_BF16 = 989e12
MFU = 0.40
"""The stated MFU for DeepSeek-V3's layers: ppsim's own default (``ppsim.plan.DEFAULT_MFU``, torchtitan's published
eager H100 runs), not fitted to DeepSeek's figures."""

EIGHT_B = "--torchtitan-config llama3:llama3_8b --parallelism.pipeline_parallel_degree 1 " \
          "--parallelism.data_parallel_shard_degree {dp} --training.local_batch_size 2"
FOUR05B = "--torchtitan-config llama3:llama3_405b --parallelism.pipeline_parallel_degree 16 " \
          "--parallelism.tensor_parallel_degree 8 --parallelism.data_parallel_shard_degree {dp} " \
          "--parallelism.pipeline_parallel_schedule {schedule} --training.local_batch_size {batch} " \
          "--parallelism.pipeline_parallel_microbatch_size 1{extra}"
DEEPSEEK = ["--parallelism.pipeline_parallel_degree", "16", "--parallelism.expert_parallel_degree", "64",
            "--parallelism.data_parallel_shard_degree", "128", "--parallelism.pipeline_parallel_schedule",
            "DualPipeV", "--training.local_batch_size", "120"]


def llama_profiles(out: Path) -> tuple[Path, Path]:
    """The 8B profile (from the 70B one: FLOPs per layer, microbatch 2, selective AC) and the 405B at TP 8."""
    eight = derive_llama(load_profile(PROFILE_70B), "8B", mb_size=2, selective=True)
    four05 = derive_llama(load_profile(PROFILE_405B), "405B", tp=8, cluster="h100")
    return save_profile(eight, out / TEST_8B.name), save_profile(four05, out / TEST_405B.name)


def simulate(args: str, profile: Path, cluster: str = "h100") -> dict[str, Any]:
    """``ppsim simulate ARGS --profile P --cluster C --json``, run as a command; its JSON."""
    cmd = [str(Path(sys.executable).with_name("ppsim")), "simulate", *args.split(), "--profile", str(profile),
           "--cluster", cluster, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT,
                          env={**os.environ, "PPSIM_CACHE_DIR": os.environ.get("PPSIM_CACHE_DIR", "/tmp/ppsim-bench")})
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def shown(args: str, profile: Path, cluster: str = "h100") -> str:
    rel = profile.name if profile.parent != ROOT / "tests/data" else f"tests/data/{profile.name}"
    return f"ppsim simulate {args} --profile {rel} --cluster {cluster} --json"


def row(what: str, published: float, predicted: float, how: str, unit: str = "") -> dict[str, Any]:
    err = predicted / published - 1
    print(f"| {what} | {published:,.4g}{unit} | {predicted:,.4g}{unit} | {err:+.1%} | {how} |")
    return {"what": what, "published": published, "predicted": predicted, "error": err, "how": how}


def eight_b(profile: Path) -> list[dict[str, Any]]:
    tokens = 2 * SEQ
    steps = {dp: simulate(EIGHT_B.format(dp=dp), profile) for dp in (8, 128)}
    tps = {dp: tokens / s["makespan"] for dp, s in steps.items()}
    rows = []
    for dp, pub in ((8, 5762), (128, 5605)):
        c = steps[dp]["collectives"]
        how = (f"`{shown(EIGHT_B.format(dp=dp), profile)}`: step {steps[dp]['makespan']:.4f} s, of which all-gather "
               f"{c['all_gather']['exposed_s'] * 1e3:.1f} ms + reduce-scatter "
               f"{c['reduce_scatter']['exposed_s'] * 1e3:.1f} ms exposed "
               f"({c['all_gather']['placement'][0]['algorithm']}); tokens/s/GPU = 2 x 8192 / step")
        rows.append(row(f"8B FSDP {dp}: tokens/s/GPU", pub, tps[dp], how))
    change, pub_change = tps[128] / tps[8] - 1, 5605 / 5762 - 1
    print(f"| 8B, 8 -> 128 GPUs: change | {pub_change:+.2%} | {change:+.2%} | {100 * (change - pub_change):+.2f} "
          "points | the two steps above, the same layer costs |")
    rows.append({"what": "8B change", "published": pub_change, "predicted": change,
                 "points": 100 * (change - pub_change)})
    return rows


def llama405_flops_per_token() -> float:
    """torchtitan's MFU count for the whole model: 6 x non-embedding parameters + 12 x layers x dim x seq."""
    shape = LLAMA3["405B"]
    return 6.0 * (shape.num_params - shape.vocab * shape.dim) + 12.0 * shape.layers * shape.dim * SEQ


def four05b(profile: Path) -> list[dict[str, Any]]:
    flops = llama405_flops_per_token()
    rows = []
    variants = [("Interleaved1F1B", " --parallelism.pipeline_parallel_layers_per_stage 1",
                 "Interleaved 1F1B, 8 stages a rank of 1 layer (the paper's layout)"),
                ("1F1B", "", "1F1B (sensitivity)"),
                ("Interleaved1F1B", "", "Interleaved 1F1B, torchtitan's default 2 stages a rank (sensitivity)")]
    for k, (schedule, extra, label) in enumerate(variants):
        tf = {}
        for dp, batch, pub in ((64, 32, 430), (128, 16, 400)):
            args = FOUR05B.format(dp=dp, schedule=schedule, batch=batch, extra=extra)
            s = simulate(args, profile)
            tf[dp] = batch * SEQ * flops / (s["makespan"] * 16 * 8) / 1e12
            c = s["collectives"]
            how = (f"{label}: `{shown(args, profile)}`: step {s['makespan']:.3f} s, bubble {s['bubble_ratio']:.1%}, "
                   f"FSDP exposed {(c['all_gather']['exposed_s'] + c['reduce_scatter']['exposed_s']) / 16:.3f} s a "
                   f"rank; TFLOP/s = {batch} x 8192 x {flops / 1e12:.3f} TFLOP / (step x 128 GPUs)")
            if k == 0:
                rows.append(row(f"405B DP {dp} ({dp * 128:,} GPUs): TFLOP/s/GPU", pub, tf[dp], how))
        change, pub_change = tf[128] / tf[64] - 1, 400 / 430 - 1
        print(f"| 405B, 8,192 -> 16,384 GPUs: change, {label} | {pub_change:+.2%} | {change:+.2%} | "
              f"{100 * (change - pub_change):+.2f} points | {tf[64]:.0f} -> {tf[128]:.0f} TFLOP/s |")
        rows.append({"what": f"405B change, {label}", "published": pub_change, "predicted": change,
                     "points": 100 * (change - pub_change)})
    return rows


def deepseek(out: Path) -> list[dict[str, Any]]:
    """DeepSeek-V3 through the library: the job's EP-local shapes (read without the profile: with one, simulate
    counts every layer's 256 routed experts, an upper bound that would charge FSDP for experts a rank does not
    hold), the layer costs from FLOPs (:func:`deepseek_from_flops`), the h800 cluster."""
    from ppsim.cli.common import build_inputs
    from ppsim.cli.job_memory import JobShapesOnce
    from ppsim.cli.simulation import step_of
    from ppsim.compare import compare
    from ppsim.step.cluster import load_cluster
    from ppsim.step.collectives import predict
    from ppsim.step.ep import all_to_all_bytes
    from ppsim.step.kinds import CollectiveKind
    from ppsim.step.placement import place

    config = "deepseek_v3:deepseek_v3_671b"
    cluster = load_cluster("h800")
    shapes_once = JobShapesOnce(config, tuple(DEEPSEEK), None, None, 1)
    shapes, degrees = shapes_once.get()
    span = place(degrees, cluster.gpus_per_node).span("ep")
    nbytes = all_to_all_bytes(shapes)
    a2a = predict(CollectiveKind.ALL_TO_ALL, nbytes, span, cluster).seconds
    seq = shapes.moe_tokens * degrees.tp
    prof = deepseek_from_flops(shapes, seq=seq, mb_size=1, peak_flops=H800_BF16, mfu=MFU, ep=degrees.ep,
                               all_to_all_s=a2a)
    path = save_profile(prof, out / "deepseek_v3_671b_h800_flops_mfu40_ep64.profile.json")
    inputs = build_inputs(None, None, None, None, costs=None, profile=path, torchtitan_config=config,
                          overrides=list(DEEPSEEK))
    result = compare(inputs.names, builder=lambda name: inputs.schedule(name), costs=inputs.cost_model,
                     step=step_of(inputs, shapes_once, cluster)).results[0]
    assert prof.blocks is not None
    moe = prof.blocks["layer.moe"]
    assert moe.F is not None and moe.B is not None
    f_compute = moe.F.median - 2 * a2a
    mbs = int(DEEPSEEK[-1])  # microbatches of one sequence per pipeline
    moe_layers = len(shapes.moe_layers)
    compute = moe_layers * mbs * 3 * f_compute  # every MoE layer's F + B compute, every microbatch, all ranks
    a = result.collectives["all_to_all"]
    ratio = a.total_s / compute
    tokens_per_gpu = mbs * seq / (result.makespan * degrees.pp)  # one pipeline: pp GPUs (TP 1)
    busy = [r.busy for r in result.per_rank]
    print(f"| DeepSeek-V3: all-to-all / MoE compute | 1:1 (about) | {ratio:.2f}:1 | forward alone "
          f"{2 * a2a:.4f} s vs {f_compute:.4f} s a MoE layer and microbatch ({2 * a2a / f_compute:.2f}:1); "
          f"{a.exposed_s / a.total_s:.1%} of the all-to-alls exposed | library: `{config} {' '.join(DEEPSEEK)}` "
          f"--profile {path.name} --cluster h800 (shapes EP-local) |")
    rows = [{"what": "DeepSeek-V3 all-to-all : MoE compute", "published": 1.0, "predicted": ratio,
             "forward": 2 * a2a / f_compute, "exposed": a.exposed_s / a.total_s}]
    rows.append(row("DeepSeek-V3 tokens/s/GPU", 1543, tokens_per_gpu,
                    f"step {result.makespan:.3f} s for {mbs} sequences of {seq} per pipeline of 16 GPUs, bubble "
                    f"{result.bubble_ratio:.1%} (busiest rank {max(busy):.1f} s, least {min(busy):.1f} s); layers from "
                    f"FLOPs at {MFU:.0%} of {H800_BF16 / 1e12:.0f} TFLOP/s bf16; one all-to-all {a2a * 1e3:.2f} ms "
                    f"({nbytes / 2**20:.0f} MiB a rank over {span.ranks} "
                    f"ranks on {span.nodes} nodes)"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/ppsim-published"))
    parser.add_argument("--write-test-data", action="store_true")
    parser.add_argument("--only", choices=("8b", "405b", "deepseek"), default=None)
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    p8, p405 = llama_profiles(ROOT / "tests/data" if opts.write_test_data else opts.out)
    print("| figure | published | predicted | error | how |")
    print("|---|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    if opts.only in (None, "8b"):
        rows += eight_b(p8)
    if opts.only in (None, "405b"):
        rows += four05b(p405)
    if opts.only in (None, "deepseek"):
        rows += deepseek(opts.out)
    (opts.out / "published.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
