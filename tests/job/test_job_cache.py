"""The job cache (ppsim/job/cache.py): a repeated `--torchtitan-config` command answers from it, the same answer; a
mistyped key is refused from the kept field names; a corrupt entry is rebuilt; a folder that cannot be written is
said once and the answer comes without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppsim.job.cache import FORMAT, JobCache, torchtitan_owns

JOB = ["simulate", "--torchtitan-config", "llama3:llama3_debugmodel", "--parallelism.pipeline_parallel_degree", "2",
       "--parallelism.data_parallel_shard_degree", "2", "--memory-cap", "2GiB", "--json"]


def _ppsim(args: list[str], cache: Path | str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PPSIM_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "ppsim.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_an_entry_round_trips_and_a_corrupt_or_foreign_one_is_rebuilt(tmp_path: Path) -> None:
    cache = JobCache(tmp_path)
    key = cache.key("job", job="llama3:x", overrides=["--a", "1"])
    assert key != cache.key("job", job="llama3:x", overrides=["--a", "2"])
    built: list[int] = []
    assert cache.get_or_build("job", key, lambda: built.append(1) or {"v": 1}) == {"v": 1}
    assert cache.get_or_build("job", key, lambda: built.append(1) or {"v": 2}) == {"v": 1} and built == [1]
    (entry,) = tmp_path.iterdir()
    for bad in (b"garbage", FORMAT + b"another key\n" + entry.read_bytes().split(b"\n", 2)[2], entry.read_bytes()[:-3]):
        entry.write_bytes(bad)
        assert cache.get_or_build("job", key, lambda: {"v": 3}) == {"v": 3}  # rebuilt, never trusted
        entry.write_bytes(entry.read_bytes())


def test_a_folder_that_cannot_be_written_is_said_once_and_the_answer_stands(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = JobCache(blocker / "ppsim")
    assert cache.get_or_build("job", cache.key("job"), lambda: 7) == 7
    assert cache.warning is not None and "cannot be written" in cache.warning
    assert cache.get_or_build("shapes", cache.key("shapes"), lambda: 8) == 8  # no second attempt, one warning


def test_only_torchtitans_own_configs_are_cached() -> None:
    pytest.importorskip("torchtitan")
    assert torchtitan_owns("llama3") and torchtitan_owns("deepseek_v3")
    assert not torchtitan_owns("my.module") and not torchtitan_owns("nope_not_a_model")


@pytest.mark.torch
@pytest.mark.slow
def test_a_repeated_job_answers_from_the_cache_with_the_same_answer(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    first = _ppsim(JOB, tmp_path)
    assert first.returncode == 0, first.stderr
    assert {p.name.split("-")[0] for p in tmp_path.iterdir()} == {"fields", "settings", "job", "shapes"}
    again = _ppsim(JOB, tmp_path)
    assert again.returncode == 0 and again.stdout == first.stdout
    assert json.loads(again.stdout)["per_rank"][0]["fits"] is True
    fresh = _ppsim(JOB, "off")
    assert fresh.stdout == first.stdout  # the cache changes the time, never the answer
    typo = [*JOB[:3], "--parallelism.pipeline_parallel_degre", "2"]
    refused = _ppsim(typo, tmp_path)
    assert refused.returncode == 2 and "did you mean --parallelism.pipeline_parallel_degree?" in refused.stderr
    probe = ("import sys\nfrom ppsim.cli import main\nsys.argv = ['ppsim', *sys.argv[1:]]\ntry:\n    main()\n"
             "except SystemExit:\n    pass\n"
             "print('torchtitan' in sys.modules, 'torch' in sys.modules, file=sys.stderr)")
    env = {**os.environ, "PPSIM_CACHE_DIR": str(tmp_path)}
    loaded = subprocess.run([sys.executable, "-c", probe, *typo], capture_output=True, text=True, env=env, timeout=300)
    assert loaded.stderr.strip().splitlines()[-1] == "False False"  # refused from the kept names: nothing imported
