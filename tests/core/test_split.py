"""Split rules: torchtitan's default spread, layers per stage, explicit counts; bad splits are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.errors import PPSimError
from ppsim.split import (
    SplitError,
    SplitSpec,
    default_split,
    parse_split,
    resolve_split,
    stage_blocks,
    stages_for_layers_per_stage,
)


# Worked examples derived by hand from torchtitan's generate_llm_fqn_per_model_part (pipeline_parallel.py):
# weighted = L + iw + ow; each stage gets weighted // S, the first weighted % S one more; the first stage gives iw of
# its share to the embedding, the last ow to the head.
@pytest.mark.parametrize(
    ("num_layers", "num_stages", "weights", "expected"),
    [
        (8, 4, (1, 1), (2, 3, 2, 1)),  # torchtitan's own test: [2, 3, 2, 1]
        (4, 2, (1, 1), (2, 2)),  # [tok_embeddings, layers.0, layers.1], [layers.2, layers.3, norm, output]
        (3, 2, (2, 2), (2, 1)),  # its docstring example: embeddings and head count as 2 layers each
        (2, 1, (1, 1), (2,)),  # one stage holds everything
        (16, 4, (1, 1), (4, 5, 4, 3)),
        (8, 8, (1, 1), (1, 2, 1, 1, 1, 1, 1, 0)),  # the last stage holds the head alone
        (7, 3, (1, 1), (2, 3, 2)),
        (32, 8, (1, 1), (4, 5, 4, 4, 4, 4, 4, 3)),
        (8, 4, (0, 0), (2, 2, 2, 2)),
    ],
)
def test_default_split_matches_torchtitans_spread(
    num_layers: int, num_stages: int, weights: tuple[int, int], expected: tuple[int, ...]
) -> None:
    iw, ow = weights
    got = default_split(num_layers, num_stages, input_weight=iw, output_weight=ow)
    assert got == expected
    assert sum(got) == num_layers


def test_default_split_refuses_more_stages_than_weighted_layers() -> None:
    with pytest.raises(SplitError, match="every stage needs at least one"):
        default_split(4, 7)


def test_default_split_refuses_a_head_heavier_than_a_stage() -> None:
    with pytest.raises(SplitError, match="weighs more"):
        default_split(2, 4, output_weight=2)


@pytest.mark.parametrize(("layers", "k", "stages"), [(8, 5, 2), (8, 3, 4), (8, 2, 5), (16, 3, 6), (30, 4, 8)])
def test_layers_per_stage_gives_torchtitans_stage_count(layers: int, k: int, stages: int) -> None:
    assert stages_for_layers_per_stage(layers, k) == stages


def test_layers_per_stage_uses_the_default_spread() -> None:
    assert resolve_split(SplitSpec(layers_per_stage=3), 8, 4) == (2, 3, 2, 1)


def test_layers_per_stage_that_misses_the_chain_length_names_a_fitting_value() -> None:
    with pytest.raises(SplitError) as info:
        resolve_split(SplitSpec(layers_per_stage=2), 8, 4, schedule="Interleaved1F1B with 2 ranks")
    message = str(info.value)
    assert "5 stages" in message and "Interleaved1F1B with 2 ranks has 4" in message
    assert "--layers-per-stage 3" in message


def test_explicit_split_is_used_as_given() -> None:
    assert resolve_split(SplitSpec(split=(3, 4, 4, 3)), 14, 4) == (3, 4, 4, 3)
    assert resolve_split(SplitSpec(split=(0, 4, 4, 0)), 8, 4) == (0, 4, 4, 0)


@pytest.mark.parametrize(
    ("counts", "layers", "stages", "needle"),
    [
        ((3, 4, 4, 3), 16, 4, "covers 14 layers but the model has 16"),
        ((3, 4, 4, 3), 14, 3, "gives 4 stages but"),
        ((3, 0, 4, 3), 10, 4, "stage 1 holds no layer"),
    ],
)
def test_bad_explicit_split_is_one_line(counts: tuple[int, ...], layers: int, stages: int, needle: str) -> None:
    with pytest.raises(SplitError) as info:
        resolve_split(SplitSpec(split=counts), layers, stages)
    message = str(info.value)
    assert needle in message and "\n" not in message and "--split" in message


@pytest.mark.parametrize("text", ["", "3,,4", "3,a,4", "3;4", "-1,2", "٣,4", "1" * 20])
def test_parse_split_refuses_what_is_not_counts(text: str) -> None:
    with pytest.raises(SplitError) as info:
        parse_split(text)
    assert "\n" not in str(info.value)


def test_parse_split_reads_counts() -> None:
    assert parse_split(" 3, 4,4 ,3") == (3, 4, 4, 3)


def test_split_and_layers_per_stage_together_are_refused() -> None:
    with pytest.raises(PPSimError, match="pass only one"):
        SplitSpec(split=(4, 4), layers_per_stage=4)


def test_stage_blocks_put_embedding_first_and_head_last() -> None:
    layout = ["embed", "layer", "layer.moe", "layer", "head"]
    assert stage_blocks(layout, (1, 2)) == (("embed", "layer"), ("layer.moe", "layer", "head"))
    assert stage_blocks(layout, (3,)) == (tuple(layout),)
    assert stage_blocks(layout, (0, 3, 0)) == (("embed",), ("layer", "layer.moe", "layer"), ("head",))


# -- on the command line -------------------------------------------------------------------------------------------


def _v2_file(tmp_path: Path) -> Path:
    from profile_v2 import make_v2_profile

    from ppsim.profile import save_profile

    return save_profile(make_v2_profile(), tmp_path / "v2.json")


def test_one_profile_ranks_schedules_with_different_stage_counts(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["simulate", "-s", "1F1B,ZBH1,Interleaved1F1B,ZBVZeroBubble,DualPipeV", "-r", "4",
                                      "-m", "8", "--profile", str(_v2_file(tmp_path)), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert {r["schedule"]: r["stages"] for r in rows} == {
        "1F1B": 4, "ZBH1": 4, "Interleaved1F1B": 8, "ZBVZeroBubble": 8, "DualPipeV": 8}
    assert "different numbers of stages" not in result.stderr


def test_split_options_change_the_simulated_step(tmp_path: Path) -> None:
    profile = str(_v2_file(tmp_path))
    runner = CliRunner()

    def makespan(*extra: str) -> float:
        result = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "4", "--profile", profile, "--json",
                                     *extra])
        assert result.exit_code == 0, result.output
        return float(json.loads(result.stdout)["makespan"])

    assert makespan() == makespan("--split", "4,4") == makespan("--layers-per-stage", "5")
    assert makespan("--split", "1,7") > makespan()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--split", "4,3"], "covers 7 layers"), (["--split", "4,x"], "not a layer count"),
     (["--layers-per-stage", "2"], "--layers-per-stage 5"),
     (["--split", "4,4", "--layers-per-stage", "5"], "only one")],
)
def test_bad_split_options_exit_2_with_one_line(tmp_path: Path, extra: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "4", "--profile",
                                      str(_v2_file(tmp_path)), *extra])
    assert result.exit_code == 2
    assert needle in result.output and result.output.count("\n") == 1


def test_export_takes_the_split_too(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    result = CliRunner().invoke(app, ["export", "-s", "1F1B", "-r", "2", "-m", "4", "--format", "json", "-o", str(out),
                                      "--profile", str(_v2_file(tmp_path)), "--split", "3,5"])
    assert result.exit_code == 0, result.output
    assert out.is_file()
