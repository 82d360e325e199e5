"""The profile file: what calibrate writes is what the simulator reads; bad files give one clear line."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from profile_v2 import make_v2_profile, make_v3_profile

from ppsim.costs import CostSpec, load_costs
from ppsim.errors import CostError
from ppsim.profile import (
    Method,
    ModelInfo,
    P2PPair,
    P2PProfile,
    P2PSample,
    Profile,
    StageProfile,
    Stat,
    load_profile,
    percentile,
    save_profile,
)


def make_profile(num_stages: int = 3, *, complete: bool = True) -> Profile:
    stages = []
    for s in range(num_stages):
        def stat(base: float) -> Stat:
            return Stat.from_samples([base * (1 + 0.01 * k) for k in range(5)])

        measured = complete or s == 0
        stages.append(StageProfile(
            stage=s, layers=(2 * s, 2 * s + 2), has_embedding=s == 0, has_head=s == num_stages - 1,
            param_bytes=1000 + s, grad_bytes=1000 + s, optimizer_bytes=2000 + 2 * s,
            output_bytes=0 if s == num_stages - 1 else 4096,
            F=stat(1e-3) if measured else None, B=stat(2e-3) if measured else None,
            I=stat(1.1e-3) if measured else None, W=stat(0.9e-3) if measured else None,
            FB=stat(3e-3) if measured else None,
            activation_bytes=50_000 if measured else None, activation_bytes_freed_by_I=0 if measured else None,
        ))
    samples = (P2PSample(bytes=4, median_s=1e-4, p10_s=9e-5, p90_s=2e-4),
               P2PSample(bytes=1 << 20, median_s=1e-3, p10_s=9e-4, p90_s=2e-3))
    return Profile(
        created="2026-11-22T10:00:00Z", device="cpu", device_name="test cpu", torch_version="2.13.0", host="h",
        world_size=1, backend=None,
        model=ModelInfo(preset="tiny", hidden=8, heads=2, ffn=16, layers=2 * num_stages, vocab=32, seq_len=4,
                        mb_size=1, dtype="float32"),
        num_stages=num_stages, stages=tuple(stages),
        p2p=P2PProfile(alpha_s=1e-4, beta_bytes_per_s=1e9, fit_rel_error=0.05, measured=True, samples=samples,
                       pairs=(P2PPair(src=0, dst=1, alpha_s=1e-4, beta_bytes_per_s=1e9, fit_rel_error=0.05),)),
        complete=complete,
        done=tuple(f"stage{s}.{m}" for s in range(num_stages if complete else 1)
                   for m in ("F", "B", "IW", "FB", "memory")),
        method=Method(warmup=1, reps=5, timer="perf_counter", threads_per_rank=1, wall_s=1.5),
        notes=("a note",),
    )


def write_json(tmp_path: Path, data: Any, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def load_error(path: Path, **kw: Any) -> str:
    with pytest.raises(CostError) as info:
        load_profile(path, **kw)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    return message


def test_saved_profile_loads_back_equal(tmp_path: Path) -> None:
    profile = make_profile()
    path = save_profile(profile, tmp_path / "p.json")
    assert load_profile(path) == profile
    data = json.loads(path.read_text())
    assert data["schema"] == "ppsim.profile" and data["version"] == 1


def test_json_keys_follow_the_agreed_schema(tmp_path: Path) -> None:
    data = make_profile().to_dict()
    for key in ("created", "device", "device_name", "torch_version", "host", "world_size", "backend", "model",
                "num_stages", "stages", "p2p", "complete", "done"):
        assert key in data
    stage = data["stages"][0]
    for key in ("stage", "layers", "has_embedding", "has_head", "F", "B", "I", "W", "FB", "activation_bytes",
                "activation_bytes_freed_by_I", "param_bytes", "grad_bytes", "optimizer_bytes", "output_bytes"):
        assert key in stage
    assert set(stage["F"]) == {"median", "p10", "p90", "samples", "n"}
    assert {"alpha_s", "beta_bytes_per_s", "fit_rel_error", "measured", "samples"} <= set(data["p2p"])


def test_stat_percentiles_match_numpy() -> None:
    rng = np.random.default_rng(0)
    samples = list(rng.exponential(size=37))
    stat = Stat.from_samples(samples)
    assert stat.n == 37 and stat.samples == tuple(samples)
    for value, q in ((stat.p10, 10), (stat.median, 50), (stat.p90, 90)):
        assert value == pytest.approx(float(np.percentile(samples, q)))
    assert percentile([3.0], 90) == 3.0


def test_profile_drives_the_cost_model(tmp_path: Path) -> None:
    profile = make_profile()
    path = save_profile(profile, tmp_path / "p.json")
    costs = load_costs(None, path).tables
    assert costs.F == tuple(st.F.median for st in profile.stages)
    assert costs.W == tuple(st.W.median for st in profile.stages)
    assert CostSpec.from_profile(profile).tables.B == costs.B


def test_incomplete_profile_is_refused_unless_asked_for(tmp_path: Path) -> None:
    path = save_profile(make_profile(complete=False), tmp_path / "p.json")
    message = load_error(path)
    assert "--resume" in message and "incomplete" in message
    partial = load_profile(path, allow_incomplete=True)
    assert not partial.complete and partial.stages[1].F is None and partial.stages[0].F is not None


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.update(schema="other"), "not a ppsim profile"),
        (lambda d: d.pop("schema"), "not a ppsim profile"),
        (lambda d: d.update(version=99), "version 99 is not supported"),
        (lambda d: d["stages"][1].pop("F"), "stages[1].F is missing"),
        (lambda d: d["stages"][0].pop("output_bytes"), "stages[0].output_bytes is missing"),
        (lambda d: d["model"].pop("hidden"), "model.hidden is missing"),
        (lambda d: d["stages"][2]["W"].update(median="fast"), "stages[2].W.median must be a finite number"),
        (lambda d: d["stages"][0]["F"].update(p10=1.0), "p10 <= median <= p90"),
        (lambda d: d["stages"][0].update(activation_bytes_freed_by_I=10**9), "more than activation_bytes"),
        (lambda d: d.update(num_stages=5), "lists 3 stages but num_stages is 5"),
        (lambda d: d["p2p"].update(beta_bytes_per_s=0), "p2p.beta_bytes_per_s must be a finite number > 0"),
        (lambda d: d.update(device="tpu"), "device must be one of cpu, cuda"),
        (lambda d: d["stages"][1].update(stage=7), "stages must be listed in order"),
        (lambda d: d["stages"][0].update(F=None), "stages[0].F is not measured"),
    ],
)
def test_malformed_profile_gives_one_line_naming_the_field(tmp_path: Path, edit: Any, expected: str) -> None:
    data = copy.deepcopy(make_profile().to_dict())
    edit(data)
    assert expected in load_error(write_json(tmp_path, data))


def test_unreadable_files_give_one_line(tmp_path: Path) -> None:
    assert "file not found" in load_error(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "ppsim.profile",')
    assert "not valid JSON" in load_error(bad)
    assert "must be a JSON object" in load_error(write_json(tmp_path, [1, 2]))
    assert "is a directory" in load_error(tmp_path)


def test_failed_save_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_profile(make_profile(complete=False), tmp_path / "p.json")
    before = path.read_text()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        save_profile(make_profile(), path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


# -- version 2: blocks ---------------------------------------------------------------------------------------------


def test_v2_profile_saves_and_loads_back_equal(tmp_path: Path) -> None:
    profile = make_v2_profile()
    path = save_profile(profile, tmp_path / "p2.json")
    data = json.loads(path.read_text())
    assert data["version"] == 2 and set(data["blocks"]) == {"embed", "layer", "head"}
    assert data["layout"] == ["embed"] + ["layer"] * 8 + ["head"]
    assert data["runtime"]["compute_scale"] == {"1": 1.0, "2": 1.5}
    loaded = load_profile(path)
    assert loaded == profile and loaded.version == 2 and loaded.num_layers == 8


def test_v2_incomplete_profile_loads_only_for_resume(tmp_path: Path) -> None:
    path = save_profile(make_v2_profile(complete=False), tmp_path / "p2.json")
    assert "incomplete" in load_error(path)
    assert load_profile(path, allow_incomplete=True).blocks["layer"].F is None


def _v2_dict() -> dict[str, Any]:
    return make_v2_profile().to_dict()


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d["layout"].pop(), "layout"),
        (lambda d: d["layout"].insert(1, "layer"), "holds 9 layers but model.layers is 8"),
        (lambda d: d["layout"].__setitem__(2, "head"), "layout[2]"),
        (lambda d: d["layout"].__setitem__(2, "layer.moe"), "which 'blocks' does not hold"),
        (lambda d: d["blocks"].__setitem__("mlp", d["blocks"]["layer"]), "'mlp'"),
        (lambda d: d["blocks"]["layer"].pop("F"), "blocks.layer.F is missing"),
        (lambda d: d.__setitem__("stage_overhead", None), "stage_overhead is not measured"),
        (lambda d: d["runtime"].__setitem__("recv_posting", "late"), "runtime.recv_posting"),
        (lambda d: d["runtime"]["compute_scale"].__setitem__("two", 1.5), "key 'two'"),
        (lambda d: d["runtime"]["compute_scale"].__setitem__("2", 0), "compute_scale.2"),
        (lambda d: d["runtime"].__setitem__("dispatch_s", -1), "runtime.dispatch_s"),
        (lambda d: d["runtime"]["synthetic"].__setitem__("synthetic", copy.deepcopy(d["runtime"]["synthetic"])),
         "must be null"),
        (lambda d: d["runtime"]["probe"].__setitem__("ranks", 0), "runtime.probe.ranks"),
        (lambda d: d.__setitem__("version", 4), "version 4 is not supported"),
        (lambda d: d.__setitem__("version", True), "version True is not supported"),
    ],
)
def test_bad_v2_profiles_are_one_line_errors(tmp_path: Path, change: Any, needle: str) -> None:
    data = _v2_dict()
    change(data)
    assert needle in load_error(write_json(tmp_path, data))


def test_v2_profile_may_keep_directly_measured_stages(tmp_path: Path) -> None:
    stages = make_profile(2).stages
    profile = make_v2_profile(stages=stages)
    loaded = load_profile(save_profile(profile, tmp_path / "p.json"))
    assert loaded.stages == stages and loaded.num_stages == 2 and loaded.version == 2


def test_v2_profile_without_runtime_loads() -> None:
    assert Profile.from_dict(make_v2_profile(runtime=False).to_dict()).runtime is None


# -- version 3: the model source and one block per layer kind --------------------------------------------------------


def test_v3_profile_saves_and_loads_back_equal(tmp_path: Path) -> None:
    profile = make_v3_profile()
    data = json.loads(save_profile(profile, tmp_path / "p3.json").read_text())
    assert data["version"] == 3 and data["source"]["layer_kinds"] == ["dense", "moe", "moe", "moe"]
    assert data["layout"] == ["embed", "layer.dense", "layer.moe", "layer.moe", "layer.moe", "head"]
    loaded = load_profile(tmp_path / "p3.json")
    assert loaded == profile and loaded.version == 3 and loaded.source.attention.startswith("sdpa")


def test_v3_stages_add_up_the_layers_they_hold(tmp_path: Path) -> None:
    """Stage 0 holds the embedding and the dense layer, stage 1 three MoE layers and the head: each stage costs
    its own blocks (MoE layers cost twice a dense one here)."""
    from ppsim.schedules import get_schedule

    profile = make_v3_profile()
    schedule = get_schedule("1F1B", 2, 4)
    costs = load_costs(profile=save_profile(profile, tmp_path / "p3.json"), split="1,3").for_schedule(schedule)
    b, over = profile.blocks, profile.stage_overhead
    assert costs.F[0] == pytest.approx(b["embed"].F.median + b["layer.dense"].F.median + over.F.median)
    assert costs.F[1] == pytest.approx(3 * b["layer.moe"].F.median + b["head"].F.median + over.F.median)
    assert costs.activation_bytes == (b["embed"].activation_bytes + b["layer.dense"].activation_bytes,
                                      3 * b["layer.moe"].activation_bytes + b["head"].activation_bytes)
    swapped = load_costs(profile=tmp_path / "p3.json", split="3,1").for_schedule(schedule)
    assert swapped.F[0] == pytest.approx(b["embed"].F.median + b["layer.dense"].F.median
                                         + 2 * b["layer.moe"].F.median + over.F.median)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d.pop("source"), "source is missing"),
        (lambda d: d["source"]["layer_kinds"].pop(), "lists 3 layers but model.layers is 4"),
        (lambda d: d["source"]["layer_kinds"].__setitem__(1, "dense"), "layout[2] is 'layer.moe'"),
        (lambda d: d["source"].__setitem__("num_params", -1), "source.num_params"),
        (lambda d: d["source"].__setitem__("attention", 3), "source.attention"),
    ],
)
def test_bad_v3_profiles_are_one_line_errors(tmp_path: Path, change: Any, needle: str) -> None:
    data = make_v3_profile().to_dict()
    change(data)
    assert needle in load_error(write_json(tmp_path, data))


def test_v1_and_v2_profiles_still_load(tmp_path: Path) -> None:
    assert load_profile(save_profile(make_v2_profile(), tmp_path / "v2.json")).version == 2
    assert load_profile(save_profile(make_profile(), tmp_path / "v1.json")).version == 1


# -- hostile files: one line, never a traceback -------------------------------------------------------------------


def test_a_5000_digit_integer_is_one_line(tmp_path: Path) -> None:
    text = json.dumps(_v2_dict()).replace('"activation_bytes": 5000', '"activation_bytes": ' + "9" * 5000, 1)
    path = tmp_path / "p.json"
    path.write_text(text)
    message = load_error(path)
    assert len(message) < 400


def test_a_4000_digit_integer_is_refused_with_its_size(tmp_path: Path) -> None:
    text = json.dumps(_v2_dict()).replace('"activation_bytes": 5000', '"activation_bytes": ' + "9" * 4000, 1)
    path = tmp_path / "p.json"
    path.write_text(text)
    message = load_error(path)
    assert "4000 digits" in message and len(message) < 400


def test_a_10000_deep_array_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("[" * 10_000 + "]" * 10_000)
    assert "nested too deeply" in load_error(path)


def test_activation_bytes_beyond_int64_are_refused(tmp_path: Path) -> None:
    data = _v2_dict()
    data["blocks"]["layer"]["activation_bytes"] = 2**63
    assert "largest count accepted" in load_error(write_json(tmp_path, data))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_refused(tmp_path: Path, literal: str) -> None:
    text = json.dumps(_v2_dict()).replace('"dispatch_s": 0.001', f'"dispatch_s": {literal}', 1)
    assert literal in text
    path = tmp_path / "p.json"
    path.write_text(text)
    assert literal in load_error(path)


def test_a_float_overflowing_to_infinity_is_refused(tmp_path: Path) -> None:
    text = json.dumps(_v2_dict()).replace('"dispatch_s": 0.001', '"dispatch_s": 1e400', 1)
    path = tmp_path / "p.json"
    path.write_text(text)
    assert "runtime.dispatch_s" in load_error(path)


def test_a_huge_file_is_refused_before_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ppsim.profile as profile_module

    monkeypatch.setattr(profile_module, "MAX_PROFILE_BYTES", 1000)
    path = write_json(tmp_path, _v2_dict())
    assert "more than a profile can hold" in load_error(path)


def test_a_huge_string_value_is_cut_in_the_message(tmp_path: Path) -> None:
    data = _v2_dict()
    data["runtime"]["recv_posting"] = "x" * 100_000
    assert len(load_error(write_json(tmp_path, data))) < 400


def test_measured_fields_are_read_from_the_block_dataclass() -> None:
    """Adding a measured field is one line in Block (and StageProfile): the reader and writer follow its fields."""
    from dataclasses import fields

    from ppsim.profile import MEASURED, OPS, Block, StageProfile

    assert MEASURED.stats == OPS
    assert set(MEASURED.stats + MEASURED.ints + MEASURED.optional_ints) == {f.name for f in fields(Block)}
    assert {f.name for f in fields(Block)} <= {f.name for f in fields(StageProfile)}
    assert MEASURED.unmeasured_ints == ("activation_bytes", "activation_bytes_freed_by_I")
    assert list(Block(1, 2, 3, 4).to_dict()) == [*MEASURED.stats, *MEASURED.ints, *MEASURED.optional_ints]


def _every_record_profile() -> Profile:
    """A version-3 profile holding every :class:`ppsim.profile.Record`: runtime (synthetic, probe, samples), p2p
    with pairs and samples, collectives, and a method with its host load."""
    import dataclasses

    from ppsim.profile import CollectiveFit, HostLoad

    base = make_v3_profile()
    sample = P2PSample(bytes=8, median_s=2e-5, p10_s=1e-5, p90_s=3e-5)
    pair = P2PPair(src=0, dst=1, alpha_s=1e-5, beta_bytes_per_s=2e9, fit_rel_error=0.1, samples=(sample,))
    return dataclasses.replace(
        base,
        p2p=P2PProfile(alpha_s=1e-4, beta_bytes_per_s=1e9, fit_rel_error=0.05, measured=True, samples=(sample,),
                       pairs=(pair,)),
        collectives=(CollectiveFit(op="all_gather", group_size=2, alpha_s=1e-5, beta_bytes_per_s=1e9,
                                   fit_rel_error=0.1, samples=(sample,)),),
        method=Method(warmup=1, reps=5, timer="perf_counter", threads_per_rank=1, wall_s=1.0,
                      host=HostLoad(load_avg=1.2, num_cpus=4, spread=0.1)),
    )


WHERE = {"RuntimeOverheads": "runtime", "Probe": "runtime.probe", "P2PProfile": "p2p", "P2PPair": "p2p.pairs[0]",
         "P2PSample": "p2p.samples[0]", "CollectiveFit": "collectives[0]", "Method": "method",
         "HostLoad": "method.host"}


def _at(data: dict[str, Any], where: str) -> dict[str, Any]:
    node: Any = data
    for part in where.replace("[", ".[").split("."):
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    return node


def test_records_are_written_field_by_field_and_read_back_equal(tmp_path: Path) -> None:
    profile = _every_record_profile()
    data = profile.to_dict()
    assert data["runtime"] == {
        "compute_scale": {"1": 1.0, "2": 1.5}, "dispatch_s": 1e-3, "handoff_s": 4e-3, "recv_posting": "consumer",
        "synthetic": {"compute_scale": {"1": 1.0}, "dispatch_s": 5e-4, "handoff_s": 1e-3, "recv_posting": "consumer",
                      "synthetic": None, "probe": None, "samples": {}},
        "probe": {"schedule": "1F1B", "ranks": 2, "microbatches": 4, "steps": 5},
        "samples": {"dispatch_s": [0.9e-3, 1e-3, 1.1e-3], "compute_scale.2": [1.4, 1.5, 1.6]}}
    assert list(data["p2p"]) == ["alpha_s", "beta_bytes_per_s", "fit_rel_error", "measured", "samples", "pairs"]
    assert data["method"]["host"] == {"load_avg": 1.2, "num_cpus": 4, "spread": 0.1}
    assert "host" not in make_profile().to_dict()["method"]  # left out when None, as older profiles have it
    assert load_profile(save_profile(profile, tmp_path / "p.json")) == profile


def test_every_record_field_is_checked_as_its_type_says(tmp_path: Path) -> None:
    """The readers are generated from the records' fields: each scalar field refuses a value of another type, in
    one line naming its path."""
    from dataclasses import fields

    from ppsim.profile import _RECORDS

    assert set(WHERE) == set(_RECORDS)
    checked = 0
    for name, cls in _RECORDS.items():
        for f in fields(cls):
            if f.type.removesuffix(" | None") not in ("int", "float", "str", "bool"):
                continue
            data = _every_record_profile().to_dict()
            _at(data, WHERE[name])[f.name] = [1] if f.type == "str" else "seven"
            assert f"{WHERE[name]}.{f.name} must be" in load_error(write_json(tmp_path, data)), (name, f.name)
            checked += 1
    assert checked >= 25


@pytest.mark.parametrize(("where", "value", "needle"), [
    ("runtime.probe", {"ranks": 0}, "runtime.probe.ranks must be an integer >= 1, got 0"),
    ("collectives[0]", {"group_size": 1}, "collectives[0].group_size must be an integer >= 2, got 1"),
    ("collectives[0]", {"op": "broadcast"},
     "collectives[0].op must be one of all_to_all, all_gather, reduce_scatter, all_reduce, send_recv"),
    ("p2p.pairs[0]", {"beta_bytes_per_s": 0}, "p2p.pairs[0].beta_bytes_per_s must be a finite number > 0, got 0"),
    ("runtime", {"recv_posting": "late"}, "runtime.recv_posting must be one of early, consumer, got 'late'"),
    ("runtime.synthetic", {"synthetic": {}}, "runtime.synthetic.synthetic must be null inside runtime.synthetic"),
    ("method", {"threads_per_rank": 0}, "method.threads_per_rank must be an integer >= 1, got 0"),
    ("method.host", {"num_cpus": 0}, "method.host.num_cpus must be an integer >= 1, got 0"),
    ("p2p.pairs[0]", {"samples": "x"}, "p2p.pairs[0].samples must be a list, got a string"),
])
def test_field_metadata_sets_the_rule(tmp_path: Path, where: str, value: dict[str, Any], needle: str) -> None:
    data = _every_record_profile().to_dict()
    _at(data, where).update(value)
    assert needle in load_error(write_json(tmp_path, data))


@pytest.mark.parametrize("where", ["runtime.probe", "method.host", "runtime.handoff_s", "method.wall_s",
                                   "p2p.pairs", "p2p.samples", "runtime.samples", "collectives[0].samples"])
def test_optional_record_fields_may_be_left_out(where: str) -> None:
    data = _every_record_profile().to_dict()
    parent, _, key = where.rpartition(".")
    del _at(data, parent)[key]
    Profile.from_dict(data, source="p.json")


def test_a_new_record_field_is_one_line() -> None:
    """A record declares its fields once: the writer and the reader (with the field's rule) follow them."""
    from dataclasses import dataclass, field

    from ppsim.profile import Record, _Reader, at_least, one_of

    @dataclass(frozen=True)
    class Extra(Record):
        count: int = field(metadata=at_least(2))
        rate: float | None = None
        mode: str = field(default="a", metadata=one_of(("a", "b")))

    extra = Extra(count=3, rate=0.5, mode="b")
    assert extra.to_dict() == {"count": 3, "rate": 0.5, "mode": "b"}
    assert _Reader("p.json").record(Extra, extra.to_dict(), "extra") == extra
    with pytest.raises(CostError, match=r"extra\.count must be an integer >= 2, got 1"):
        _Reader("p.json").record(Extra, {"count": 1, "mode": "a"}, "extra")
