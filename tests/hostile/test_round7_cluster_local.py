"""``scripts/cluster-local.sh`` tried as a hostile user would (issue 41 item 7): start twice, stop without start,
status, the edges of --nodes, --link and --prefix, exec to a node that does not exist, a non-root user. Every
namespace, veth and bridge it made is gone after stop. Needs root and network namespaces (skipped otherwise); uses
its own prefix and state folder, never another prefix's nodes."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster-local.sh"
PREFIX = "h10t"
pytestmark = pytest.mark.slow


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces refused here ({probe.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}-probe"], capture_output=True)
    return None


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    why = _why_not()
    if why:
        pytest.skip(why)
    e = {**os.environ, "PPSIM_CLUSTER_DIR": str(tmp_path_factory.mktemp("state"))}
    yield e
    subprocess.run([str(SCRIPT), "stop", "--prefix", PREFIX], env=e, capture_output=True, timeout=120)


def _run(env: dict[str, str], *args: str, user: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [str(SCRIPT), *args]
    if user:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _ours() -> tuple[list[str], list[str]]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return ([n for n in names if n.startswith(f"{PREFIX}-")],
            [ln for ln in links.splitlines() if f" {PREFIX}-" in ln])


def _one_line(done: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cluster-local: "), done.stderr
    return lines[0]


def test_stop_and_status_without_start(env: dict[str, str]) -> None:
    assert _run(env, "stop", "--prefix", PREFIX).returncode == 0
    assert _run(env, "status", "--prefix", PREFIX).returncode == 3
    assert _ours() == ([], [])


@pytest.mark.parametrize("args, named", [
    (["--nodes", "0", "--link", "1gbit"], "--nodes 0"), (["--nodes", "251", "--link", "1gbit"], "--nodes 251"),
    (["--nodes", "2", "--link", "0"], "--link 0"), (["--nodes", "2", "--link", "-5mbit"], "--link -5mbit"),
    (["--nodes", "2", "--link", "0bit"], "--link 0bit"), (["--nodes", "2", "--link", "7bit"], "--link 7bit"),
    (["--nodes", "2", "--link", "1gbit", "--delay", "-1ms"], "--delay -1ms"),
])
def test_bad_start_arguments_are_one_line_and_start_nothing(env: dict[str, str], args: list[str],
                                                            named: str) -> None:
    """``--link 0bit`` used to reach tc and blame the kernel ("is sch_tbf in the kernel?")."""
    assert named in _one_line(_run(env, "start", *args, "--prefix", PREFIX))
    assert _ours() == ([], [])


@pytest.mark.parametrize("prefix", ["h10-x", "abcdefghijk", "9abc", "h10 x", "h10;x"])
def test_odd_or_long_prefixes_are_refused(env: dict[str, str], prefix: str) -> None:
    assert "--prefix" in _one_line(_run(env, "start", "--nodes", "1", "--link", "1gbit", "--prefix", prefix))


def test_exec_to_a_node_that_does_not_exist(env: dict[str, str]) -> None:
    assert "does not exist" in _one_line(_run(env, "exec", "7", "--prefix", PREFIX, "--", "true"), code=3)
    assert "node number" in _one_line(_run(env, "exec", "x", "--prefix", PREFIX, "--", "true"))


def test_a_non_root_user_is_one_line(env: dict[str, str]) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed")
    for args in (["start", "--nodes", "1", "--link", "1gbit"], ["stop"], ["exec", "0"]):
        extra = ["--", "true"] if args[0] == "exec" else []
        assert "root" in _one_line(_run(env, *args, "--prefix", PREFIX, *extra, user=True))
    assert _ours() == ([], [])


def test_start_twice_one_node_status_and_stop_leave_nothing(env: dict[str, str]) -> None:
    started = _run(env, "start", "--nodes", "1", "--link", "1gbit", "--prefix", PREFIX)
    assert started.returncode == 0, started.stderr
    again = _run(env, "start", "--nodes", "1", "--link", "1gbit", "--prefix", PREFIX)
    assert again.returncode == 0 and "already running" in again.stdout
    other = _run(env, "start", "--nodes", "2", "--link", "1gbit", "--prefix", PREFIX)
    assert other.returncode != 0 and "another shape" in other.stderr
    status = _run(env, "status", "--prefix", PREFIX)
    assert status.returncode == 0 and f"{PREFIX}-node0" in status.stdout and "tbf" in status.stdout
    sleeper = subprocess.Popen([str(SCRIPT), "exec", "0", "--prefix", PREFIX, "--", "sleep", "300"], env=env)
    try:
        stopped = _run(env, "stop", "--prefix", PREFIX)
        assert stopped.returncode == 0, stopped.stderr
        assert sleeper.wait(timeout=30) != 0  # the process in the node was ended by stop
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    assert _ours() == ([], [])


def test_65_nodes_start_and_stop_clean(env: dict[str, str]) -> None:
    started = _run(env, "start", "--nodes", "65", "--link", "100mbit", "--prefix", PREFIX)
    assert started.returncode == 0, started.stderr
    namespaces, links = _ours()
    assert len(namespaces) == 65 and len(links) == 66  # 65 veths and the bridge
    assert max(len(ln.split(": ")[1].split("@")[0]) for ln in links) <= 15
    assert _run(env, "stop", "--prefix", PREFIX).returncode == 0
    assert _ours() == ([], [])
