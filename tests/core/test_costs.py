"""The cost model: parsing --costs, reading a profile, and the one duration/comm rule everything uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ppsim import get_schedule
from ppsim.costs import CostSpec, load_costs, parse_costs
from ppsim.errors import CostError
from ppsim.ir import Action, ActionType, overlap, parse_action


def make_profile(num_stages: int = 4, *, p2p: bool = True, scale: float = 1.0) -> dict[str, Any]:
    """A synthetic profile in the interfaces.md schema: first/last stages differ (embedding, head)."""

    def stat(x: float) -> dict[str, Any]:
        return {"median": x * scale, "p10": x * scale, "p90": x * scale, "samples": [x * scale], "n": 1}

    stages = []
    for i in range(num_stages):
        extra = 0.5 if i == 0 else (1.0 if i == num_stages - 1 else 0.0)
        f, b = 1.0 + extra, 2.0 + 2 * extra
        stages.append(
            {
                "stage": i, "layers": [i, i + 1], "has_embedding": i == 0, "has_head": i == num_stages - 1,
                "F": stat(f), "B": stat(b), "I": stat(b / 2), "W": stat(b / 2), "FB": stat(0.9 * (f + b)),
                "activation_bytes": 1000 * (i + 1), "activation_bytes_freed_by_I": 400 * (i + 1),
                "param_bytes": 10_000, "grad_bytes": 10_000, "optimizer_bytes": 20_000 + i,
                "output_bytes": 0 if i == num_stages - 1 else 4096,
            }
        )
    return {
        "schema": "ppsim.profile", "version": 1, "created": "2026-11-22T10:00:00Z", "device": "cpu",
        "device_name": "test", "torch_version": "2.13.0", "host": "h", "world_size": 1, "backend": None,
        "model": {"preset": "tiny", "hidden": 8, "heads": 2, "ffn": 16, "layers": num_stages, "vocab": 32,
                  "seq_len": 4, "mb_size": 1, "dtype": "float32"},
        "num_stages": num_stages,
        "stages": stages,
        "p2p": {"alpha_s": 0.25, "beta_bytes_per_s": 4096.0, "fit_rel_error": 0.0, "measured": True, "samples": []}
        if p2p else None,
        "complete": True,
        "done": [],
    }


# -- --costs ----------------------------------------------------------------------------------------------------


def test_default_costs_follow_the_contract() -> None:
    c = parse_costs(None)
    assert (c.F, c.B, c.I, c.W, c.FB, c.comm) == ((1.0,), (2.0,), (1.0,), (1.0,), (3.0,), 0.0)
    assert c.unit == "unit"


def test_b_given_alone_implies_i_and_w_halves_and_fb_follows() -> None:
    c = parse_costs("F=2,B=5")
    assert (c.I[0], c.W[0], c.FB[0]) == (2.5, 2.5, 7.0)


def test_i_and_w_without_b_define_b() -> None:
    c = parse_costs("I=1.5,W=0.5")
    assert c.B[0] == 2.0


def test_one_of_i_w_given_takes_the_rest_of_b() -> None:
    assert parse_costs("B=3,I=1").W[0] == 2.0


def test_full_cost_string_parses_every_key_case_insensitively() -> None:
    c = parse_costs("f=1, b=2, i=1, w=1, fb=2.5, COMM=0.1")
    assert (c.F[0], c.B[0], c.I[0], c.W[0], c.FB[0], c.comm) == (1, 2, 1, 1, 2.5, 0.1)
    assert c.source == "f=1, b=2, i=1, w=1, fb=2.5, COMM=0.1"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("X=1", "'X'"),
        ("F=abc", "not a number"),
        ("F=-1", ">= 0"),
        ("F=nan", ">= 0"),
        ("F", "no '='"),
        ("F=1,F=2", "twice"),
        ("B=1,I=3", "negative"),
    ],
)
def test_bad_cost_strings_are_one_line_errors(text: str, needle: str) -> None:
    with pytest.raises(CostError) as info:
        parse_costs(text)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_costs_and_profile_together_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(make_profile()))
    with pytest.raises(CostError, match="only one"):
        load_costs("F=1", path)


def test_to_dict_of_a_cost_string_has_scalars() -> None:
    d = parse_costs("F=1,B=4,comm=0.5").to_dict()
    assert d == {"unit": "unit", "source": "F=1,B=4,comm=0.5", "F": 1.0, "B": 4.0, "I": 2.0, "W": 2.0, "FB": 5.0,
                 "comm": 0.5}


# -- durations and comm -------------------------------------------------------------------------------------------


def test_duration_of_single_computations_and_a_pair_with_uniform_costs() -> None:
    s = get_schedule("DualPipeV", 2, 4)
    c = parse_costs("F=1,B=2,FB=2.5")
    assert c.duration(s, parse_action("0F0")) == 1.0
    assert c.duration(s, parse_action("3B1")) == 2.0
    assert c.duration(s, parse_action("3W1")) == 1.0
    assert c.duration(s, overlap(parse_action("0F3"), parse_action("3B0"))) == 2.5  # type: ignore[arg-type]


def test_comm_delay_is_zero_on_the_same_rank_and_comm_across() -> None:
    s = get_schedule("DualPipeV", 2, 4)  # rank 0 holds 0 and 3, rank 1 holds 1 and 2
    c = parse_costs("comm=0.3")
    assert c.comm_delay(s, 0, 1) == 0.3
    assert c.comm_delay(s, 3, 2) == 0.3
    assert c.comm_delay(s, 1, 2) == 0.0
    assert c.comm_delay(s, 2, 1) == 0.0


def test_profile_costs_are_per_chain_position() -> None:
    c = CostSpec.from_profile(make_profile(4)).tables
    s = get_schedule("1F1B", 4, 4)
    assert c.unit == "s"
    assert c.op_cost(s, 0, ActionType.F) == 1.5  # embedding stage
    assert c.op_cost(s, 3, ActionType.F) == 2.0  # head stage
    assert c.op_cost(s, 1, ActionType.B) == 2.0
    # one pair on the same stage takes exactly that stage's FB
    assert c.pair_duration(s, 1, 1, ActionType.B) == pytest.approx(0.9 * 3.0)


def test_profile_stage_of_the_second_dualpipe_copy_uses_its_chain_position() -> None:
    c = CostSpec.from_profile(make_profile(4)).tables
    s = get_schedule("DualPipe", 4, 8)  # stage 4 + j is position j of chain 1
    for j in range(4):
        assert c.op_cost(s, 4 + j, ActionType.F) == c.op_cost(s, j, ActionType.F)


def test_profile_p2p_time_is_alpha_plus_bytes_over_beta_and_zero_on_the_same_rank() -> None:
    c = CostSpec.from_profile(make_profile(4)).tables
    s = get_schedule("1F1B", 4, 4)
    assert c.comm_delay(s, 1, 2) == pytest.approx(0.25 + 4096 / 4096)
    assert c.comm_delay(s, 2, 1) == pytest.approx(0.25 + 4096 / 4096)  # gradient: same boundary tensor size
    v = get_schedule("DualPipeV", 2, 4)
    cv = CostSpec.from_profile(make_profile(4)).tables
    assert cv.comm_delay(v, 1, 2) == 0.0


def test_profile_without_p2p_has_zero_comm_and_says_so() -> None:
    c = CostSpec.from_profile(make_profile(4, p2p=False)).tables
    s = get_schedule("1F1B", 4, 4)
    assert c.comm_delay(s, 0, 1) == 0.0
    assert any("p2p" in note for note in c.notes)
    assert "notes" in c.to_dict()


def test_profile_with_wrong_stage_count_names_the_fix() -> None:
    c = CostSpec.from_profile(make_profile(4)).tables
    with pytest.raises(CostError, match=r"profile has 4 stages but DualPipeV with 4 ranks has 8.*--stages 8"):
        c.check(get_schedule("DualPipeV", 4, 8))


def test_load_costs_reads_a_profile_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(make_profile(2)))
    c = load_costs(None, path).tables
    assert c.source == str(path)
    assert c.static_bytes == (40_000, 40_001)
    assert c.activation_bytes == (1000, 2000)


def test_missing_profile_file_is_a_cost_error(tmp_path: Path) -> None:
    with pytest.raises(CostError, match="not found"):
        load_costs(None, tmp_path / "nope.json")


def test_profile_freeing_more_at_i_than_held_is_refused() -> None:
    bad = make_profile(2)
    bad["stages"][1]["activation_bytes_freed_by_I"] = 10**9
    with pytest.raises(CostError, match="freed_by_I"):
        _ = CostSpec.from_profile(bad).tables


def test_non_compute_actions_take_no_time() -> None:
    s = get_schedule("1F1B", 2, 2)
    assert parse_costs(None).duration(s, Action(0, ActionType.SEND_F, 0)) == 0.0


# -- per-block profiles (version 2): stages composed per schedule ---------------------------------------------------


def _v2_costs(**kw: Any) -> CostSpec:
    from profile_v2 import make_v2_profile

    return CostSpec.from_profile(make_v2_profile(**{k: v for k, v in kw.items() if k != "split"}), source="v2.json",
                                  split=kw.get("split"))


def test_one_v2_profile_drives_2_4_and_8_stage_schedules() -> None:
    from ppsim.simulator import simulate

    base = _v2_costs()
    seen = {}
    for name, ranks in (("1F1B", 2), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 4), ("1F1B", 8)):
        sched = get_schedule(name, ranks, 8)
        costs = base.for_schedule(sched)
        result = simulate(sched, costs)
        stages = len(sched.pipelines[0])
        assert costs.num_positions == stages and sum(costs.split_counts or ()) == 8
        assert result.makespan > 0
        seen[stages] = costs.split_counts
    assert seen == {2: (4, 4), 4: (2, 3, 2, 1), 8: (1, 2, 1, 1, 1, 1, 1, 0)}


def test_composed_stage_is_the_sum_of_its_blocks_plus_the_stage_overhead() -> None:
    from profile_v2 import EMBED, HEAD, LAYER, OVERHEAD


    costs = _v2_costs().for_schedule(get_schedule("1F1B", 2, 4))
    assert costs.split_counts == (4, 4)
    approx = pytest.approx
    assert costs.F[0] == approx(EMBED["F"] + 4 * LAYER["F"] + OVERHEAD["F"])
    assert costs.F[1] == approx(4 * LAYER["F"] + HEAD["F"] + OVERHEAD["F"])
    for op in ("B", "I", "W", "FB"):
        assert getattr(costs, op)[1] == approx(4 * LAYER[op] + HEAD[op] + OVERHEAD[op])
    # stage 0: its input needs no gradient, so I runs nothing and W is the whole backward
    assert costs.I[0] == approx(EMBED["I"] + OVERHEAD["I"])
    assert costs.W[0] == approx(costs.B[0])
    assert costs.activation_bytes == (1000 + 4 * 5000, 4 * 5000 + 7000)
    assert costs.activation_bytes_freed_by_I == (0, 4 * 2000 + 3000)
    assert costs.output_bytes == (8 * 4 * 1 * 4, 0)
    assert costs.static_bytes == (4 * (32 * 8 * 4) + 4 * 4 * 1000, 4 * 4 * 1000 + 4 * (32 * 8 * 4 + 32))


def test_runtime_overheads_reach_the_cost_model() -> None:

    two = _v2_costs().for_schedule(get_schedule("1F1B", 2, 4))
    assert (two.compute_scale, two.dispatch_s, two.recv_posting) == (1.5, 1e-3, "consumer")
    assert two.p2p_alpha == 4e-3 and two.p2p_beta == 1e9  # hand-off latency replaces alpha, bandwidth kept
    assert any("compute_scale 1.5 for 2 ranks" in n and "measured" in n for n in two.notes)
    four = _v2_costs().for_schedule(get_schedule("1F1B", 4, 4))
    assert four.compute_scale == 1.5 and any("largest measured count (2 ranks)" in n for n in four.notes)
    assert two.to_dict()["runtime"] == {"compute_scale": 1.5, "dispatch_s": 1e-3, "recv_posting": "consumer"}


def test_compute_scale_between_measured_counts_is_interpolated() -> None:
    from ppsim.costs import pick_compute_scale

    table = {1: 1.0, 2: 1.5, 4: 2.5}
    assert pick_compute_scale(table, 3) == (2.0, "not measured: interpolated between 2 and 4 ranks")
    assert pick_compute_scale(table, 4)[0] == 2.5
    assert pick_compute_scale({2: 1.6}, 1)[0] == 1.6  # below the smallest: never less than measured


def test_v2_profile_without_runtime_says_no_overheads_apply() -> None:

    costs = _v2_costs(runtime=False).for_schedule(get_schedule("1F1B", 2, 4))
    assert (costs.compute_scale, costs.dispatch_s, costs.recv_posting, costs.p2p_alpha) == (1.0, 0.0, "early", 1e-4)
    assert any("no runtime overheads" in n for n in costs.notes)


def test_v2_handoff_without_p2p_becomes_the_flat_comm() -> None:

    costs = _v2_costs(p2p=False).for_schedule(get_schedule("1F1B", 2, 4))
    assert costs.p2p_alpha is None and costs.comm == 4e-3


def test_a_per_block_spec_is_read_for_the_schedule_it_is_simulated_with() -> None:
    from ppsim.simulator import simulate

    sched = get_schedule("1F1B", 2, 4)
    assert simulate(sched, _v2_costs()).costs == _v2_costs().for_schedule(sched)


def test_v2_costs_to_dict_lists_blocks_and_the_split_rule() -> None:
    data = _v2_costs().to_dict()
    assert data["F"]["layer"] == pytest.approx(1e-3) and "stage_overhead" in data["F"]
    assert "torchtitan" in data["split"]


def test_explicit_split_and_layers_per_stage_reach_the_composition(tmp_path: Path) -> None:
    from profile_v2 import make_v2_profile

    from ppsim.profile import save_profile

    path = save_profile(make_v2_profile(), tmp_path / "v2.json")
    sched = get_schedule("Interleaved1F1B", 2, 4)
    assert load_costs(profile=path, split="1,3,3,1").for_schedule(sched).split_counts == (1, 3, 3, 1)
    assert load_costs(profile=path, layers_per_stage=3).for_schedule(sched).split_counts == (2, 3, 2, 1)
    with pytest.raises(CostError, match="covers 7 layers but the model has 8"):
        load_costs(profile=path, split="1,3,3")
    with pytest.raises(CostError, match="--layers-per-stage 3"):
        load_costs(profile=path, layers_per_stage=4).for_schedule(sched)
    with pytest.raises(CostError, match="--cost-scope rank"):
        load_costs(profile=path).for_schedule(sched, scope="rank")


def test_split_with_a_version_1_profile_or_a_cost_string_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(make_profile(4)))
    with pytest.raises(CostError, match="version 1"):
        load_costs(profile=path, split="1,1,1,1")
    with pytest.raises(CostError, match="per-block profile"):
        load_costs("F=1", layers_per_stage=2)


def test_version_1_profile_object_and_dict_give_the_same_tables() -> None:
    from ppsim.profile import Profile

    data = make_profile(4)
    assert CostSpec.from_profile(Profile.from_dict(data)).tables == CostSpec.from_profile(data).tables


def test_composition_is_compared_with_stages_measured_whole() -> None:
    from profile_v2 import make_v2_profile, stat

    from ppsim.profile import StageProfile

    base = _v2_costs().for_schedule(get_schedule("1F1B", 2, 4))
    ops = ("F", "B", "I", "W", "FB")
    stages = tuple(
        StageProfile(stage=s, layers=(4 * s, 4 * s + 4), has_embedding=s == 0, has_head=s == 1, param_bytes=0,
                     grad_bytes=0, optimizer_bytes=0, output_bytes=0,
                     **{op: stat(getattr(base, op)[s] * (1.1 if op == "F" else 1.0)) for op in ops},
                     activation_bytes=0, activation_bytes_freed_by_I=0)
        for s in range(2)
    )
    costs = CostSpec.from_profile(make_v2_profile(stages=stages)).for_schedule(get_schedule("1F1B", 2, 4))
    assert any("within 9.1% of the stages measured whole" in n for n in costs.notes)


def test_per_block_costs_take_another_split_through_one_checked_method() -> None:
    from ppsim.split import SplitError, SplitSpec

    base = _v2_costs()
    chosen = base.with_split(SplitSpec(layers_per_stage=2))
    assert chosen.split == SplitSpec(layers_per_stage=2) and chosen.profile is base.profile
    with pytest.raises(SplitError, match="needs a per-block profile"):
        load_costs("F=1,B=2").with_split(SplitSpec(layers_per_stage=2))
    with pytest.raises(SplitError):
        base.with_split(SplitSpec(split=(1,)))  # one stage cannot hold a split of another model's layer count
