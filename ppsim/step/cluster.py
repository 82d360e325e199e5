"""The cluster a job runs on: GPUs per node, the links within and between nodes, the NICs, the device.

One description feeds every collective's price (:mod:`ppsim.step.collectives`). It comes from a preset
(:data:`PRESETS`, each citing where its numbers come from) or a TOML/JSON file (docs/cluster.md)::

    gpus_per_node = 8
    intra_node = {bandwidth_GBps = 450, latency_us = 3}   # per GPU and direction
    inter_node = {bandwidth_GBps = 50, latency_us = 5}    # per NIC and direction
    nics_per_node = 8
    device = {name = "H100 SXM", peak_tflops = 989, memory_GiB = 80}

Optional keys: ``name``, ``source``, ``nvls``, ``backend`` (``nccl`` or ``gloo``), ``nodes``, ``shared_host``
(the nodes are emulated on one host and share its cores, as ``scripts/cluster-local.sh`` makes them),
``rank_order`` (``block``, torchrun's node-by-node numbering, the default; ``cyclic``, ranks dealt round the nodes as
Slurm's ``--distribution=cyclic`` deals them). Every mistake
in a file is one line (:class:`ClusterError`) naming the key, the rule and the fix.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ppsim.errors import PPSimError

GB = 1e9
"""Bandwidths in files are decimal gigabytes per second, as nccl-tests prints them."""
GiB = 1 << 30
BACKENDS = ("nccl", "gloo")
MAX_FILE_BYTES = 1 << 20
"""A cluster file is a few keys; a larger file is refused before it is read."""
MAX_COUNT = 1_000_000
"""The largest gpus_per_node, nics_per_node and nodes a file may give."""
BANDWIDTH_GBPS = (1e-6, 1e6)
"""A link's bandwidth in GB/s, from 1 kB/s to 1 PB/s: outside is a unit mistake (and would overflow the model)."""
MAX_LATENCY_US = 1e7
"""A link's latency, at most 10 s."""
PEAK_TFLOPS = (1e-6, 1e6)
MEMORY_GIB = (1e-6, float(1 << 33))
"""A device's memory: 1 KiB-ish to 8 EiB (ppsim's largest size)."""


class ClusterError(PPSimError):
    """A cluster preset or file that cannot be used (one line: the value, the rule, the fix)."""


@dataclass(frozen=True)
class Link:
    """One direction of a link: bytes per second and the one-way latency of a message."""

    bandwidth_Bps: float
    latency_s: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        """Alpha-beta time of ``messages`` messages carrying ``nbytes`` in all, one after another."""
        return messages * self.latency_s + nbytes / self.bandwidth_Bps

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth_GBps": _round(self.bandwidth_Bps / GB), "latency_us": _round(self.latency_s * 1e6)}


@dataclass(frozen=True)
class Device:
    """An accelerator (or a CPU rank): its name, dense peak FLOP/s and memory."""

    name: str
    peak_flops: float
    memory_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "peak_tflops": _round(self.peak_flops / 1e12),
                "memory_GiB": self.memory_bytes / GiB}


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` devices joined by ``intra_node`` links, nodes joined by ``nics_per_node`` NICs.

    ``intra_node`` is per GPU and direction (NVLink/NVSwitch, or loopback for CPU ranks); ``inter_node`` per NIC and
    direction; ``nvls``: NVLink SHARP (NVSwitch multicast) is available; ``backend``: the collective library the
    ranks use; ``num_nodes``: how many nodes there are (``None``: as many as a job asks for)."""

    name: str
    source: str
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    nics_per_node: int
    device: Device
    nvls: bool = False
    backend: str = "nccl"
    num_nodes: int | None = None
    aliases: tuple[str, ...] = field(default=(), compare=False)
    shared_host: bool = False
    """The nodes are emulated on one host (network namespaces) and its processes share that host's cores: a CPU run's
    prediction stretches compute by processor sharing as for local processes (:mod:`ppsim.step.sharing`)."""
    rank_order: str = "block"
    """How the launcher numbers ranks over the nodes: ``block`` (torchrun: node by node) or ``cyclic`` (dealt round
    the nodes: Slurm's ``--distribution=cyclic``; :mod:`ppsim.step.placement`)."""

    def nodes_for(self, gpus: int) -> int:
        """Nodes a job of ``gpus`` devices fills: 1 for a job within one node, else whole nodes only."""
        if gpus < 1:
            raise ClusterError(f"{gpus} GPUs: a job needs at least 1; give a positive count")
        if gpus <= self.gpus_per_node:
            nodes = 1
        elif gpus % self.gpus_per_node:
            raise ClusterError(
                f"{gpus} GPUs on cluster {self.name!r}: jobs larger than one node fill whole nodes of "
                f"{self.gpus_per_node}; use a multiple of {self.gpus_per_node}")
        else:
            nodes = gpus // self.gpus_per_node
        if self.num_nodes is not None and nodes > self.num_nodes:
            raise ClusterError(
                f"{gpus} GPUs need {nodes} nodes but cluster {self.name!r} has {self.num_nodes}; use at most "
                f"{self.num_nodes * self.gpus_per_node} GPUs or a larger cluster")
        return nodes

    def with_backend(self, backend: str | None) -> Cluster:
        """This cluster with its collectives run by ``backend`` (``None``: unchanged)."""
        if backend is None:
            return self
        return replace(self, backend=_backend(backend, "--backend"))

    def to_dict(self) -> dict[str, Any]:
        """The file format (:func:`parse_cluster` reads it back)."""
        out: dict[str, Any] = {"name": self.name, "source": self.source, "gpus_per_node": self.gpus_per_node,
                               "intra_node": self.intra_node.to_dict(), "inter_node": self.inter_node.to_dict(),
                               "nics_per_node": self.nics_per_node, "device": self.device.to_dict(),
                               "nvls": self.nvls, "backend": self.backend}
        if self.num_nodes is not None:
            out["nodes"] = self.num_nodes
        if self.shared_host:
            out["shared_host"] = True
        if self.rank_order != "block":
            out["rank_order"] = self.rank_order
        return out

    def to_toml(self) -> str:
        """The file format as TOML text (``load_cluster`` of a ``.toml`` file with it gives this cluster back)."""
        lines = []
        for key, value in self.to_dict().items():
            lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _round(x: float) -> float:
    return float(f"{x:.12g}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


# ----------------------------------------------------------------------------------------------------------- presets

_NCCL_TUNING = "NCCL src/graph/tuning.cc (hardware latencies: NVLink ring 0.6-3.4 us, network 2.7-14 us)"
_H100_SOURCE = ("HGX H100 SXM: NVLink4 as NCCL reckons it (src/graph/topo.h SM90_NVLINK_BW 20.6 GB/s x 18 links = "
                "370.8 GB/s per GPU and direction), intra latency NCCL's NVLink ring/Simple 3.4 us; 8 x 400 Gb/s "
                "ConnectX-7 (50 GB/s each), 5 us; H100 SXM datasheet 989 TFLOP/s bf16 dense; as in torchtitan's and "
                "Llama 3's clusters (Llama 3 paper, sec. 3.3.1); " + _NCCL_TUNING)


def _hgx_h100(name: str, device: Device, source: str, aliases: tuple[str, ...] = ()) -> Cluster:
    """An HGX H100 node's fabric (NVLink4 + NVSwitch with NVLS, 8 x 400 Gb/s NICs) with ``device``."""
    return Cluster(name=name, source=source, gpus_per_node=8, intra_node=Link(20.6e9 * 18, 3.4e-6),
                   inter_node=Link(50e9, 5e-6), nics_per_node=8, device=device, nvls=True, aliases=aliases)


def this_host(ranks: int | None = None) -> Cluster:
    """CPU ranks on this machine, one 'node' of ``ranks`` (default: every core) joined by loopback (gloo)."""
    cores = ranks or os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        memory = 16 * GiB
    return Cluster(
        name="this-host", aliases=("local",),
        source=("CPU ranks on this host: loopback defaults 2 GB/s and 50 us (a profile's measured point-to-point "
                "replaces them), a conservative 50 GFLOP/s per rank, the host's memory"),
        gpus_per_node=cores, intra_node=_LOOPBACK, inter_node=_LOOPBACK, nics_per_node=1,
        device=Device("CPU", 50e9, int(memory)), backend="gloo", num_nodes=1)


_LOOPBACK = Link(2e9, 50e-6)
"""Default loopback between CPU ranks (gloo over TCP on one host): ~2 GB/s, ~50 us per message."""

PRESETS: dict[str, Cluster] = {
    "h100": _hgx_h100("h100", Device("H100 SXM", 989e12, 80 * GiB), _H100_SOURCE, ("hgx-h100",)),
    "h100-96gb": _hgx_h100(
        "h100-96gb", Device("H100 SXM 96GB", 989e12, 96_000_000_000),
        "torchtitan's Grand Teton H100 (96 GB HBM2e per GPU, torchtitan paper sec. 4) on the HGX H100 fabric: "
        + _H100_SOURCE),
    "h800": Cluster(
        name="h800", aliases=("deepseek-h800",),
        source=("DeepSeek-V3 technical report sec. 3.1: 8 H800 per node joined by NVLink/NVSwitch at 160 GB/s, 8 "
                "InfiniBand NICs of 400 Gb/s (50 GB/s) per node; 989 TFLOP/s bf16 dense, 80 GiB; latencies "
                "per " + _NCCL_TUNING),
        gpus_per_node=8, intra_node=Link(160e9, 3.4e-6), inter_node=Link(50e9, 5e-6), nics_per_node=8,
        device=Device("H800 SXM", 989e12, 80 * GiB), nvls=True),
    "a100": Cluster(
        name="a100",
        source=("DGX A100: NVLink3 as NCCL reckons it (SM80_NVLINK_BW 20 GB/s x 12 links = 240 GB/s per GPU and "
                "direction), 8 x 200 Gb/s HDR InfiniBand (25 GB/s each); A100 datasheet 312 TFLOP/s bf16 dense, "
                "80 GiB; latencies per " + _NCCL_TUNING),
        gpus_per_node=8, intra_node=Link(240e9, 3.4e-6), inter_node=Link(25e9, 5e-6), nics_per_node=8,
        device=Device("A100 SXM 80GB", 312e12, 80 * GiB)),
    "this-host": this_host(),
    "emulated-1gbit": Cluster(
        name="emulated-1gbit",
        source=("the two-node emulation `scripts/cluster-local.sh start --nodes 2 --link 1gbit`: 2 nodes of 2 gloo "
                "ranks, 1 Gbit/s (0.125 GB/s) and 100 us between them (tc netem), loopback defaults within"),
        gpus_per_node=2, intra_node=_LOOPBACK, inter_node=Link(0.125e9, 100e-6), nics_per_node=1,
        device=Device("CPU", 50e9, 16 * GiB), backend="gloo", num_nodes=2, shared_host=True),
}
"""Named clusters (``--cluster NAME``, case-insensitive; aliases too)."""


def _by_name() -> dict[str, Cluster]:
    names: dict[str, Cluster] = {}
    for key, cluster in PRESETS.items():
        names[key] = cluster
        for alias in cluster.aliases:
            names[alias] = cluster
    return names


def list_presets() -> list[Cluster]:
    """Every preset, in the order of :data:`PRESETS` (for ``ppsim list --clusters``)."""
    return list(PRESETS.values())


def preset_names() -> list[str]:
    """Every name a preset answers to."""
    return list(_by_name())


def load_cluster(text: str) -> Cluster:
    """A preset by name (any case) or a cluster file (``.toml`` / ``.json``)."""
    key = text.strip().lower()
    if not key:
        raise ClusterError(f"--cluster {text!r}: empty; choose one of {', '.join(preset_names())} or give a cluster "
                           "file (docs/cluster.md)")
    found = _by_name().get(key)
    if found is not None:
        return found
    path = Path(text)
    if path.suffix.lower() not in (".toml", ".json"):
        raise ClusterError(f"--cluster {text!r}: not a preset nor a .toml/.json file; choose one of "
                           f"{', '.join(preset_names())} or give a cluster file (docs/cluster.md)")
    if not path.is_file():
        raise ClusterError(f"--cluster {text!r}: file not found; check the path, or use a preset "
                           f"({', '.join(PRESETS)})")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ClusterError(f"--cluster {text!r}: {path.stat().st_size} bytes, more than a cluster file's "
                           f"{MAX_FILE_BYTES} (a few keys); give the cluster file (docs/cluster.md)")
    try:
        body = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ClusterError(f"--cluster {text!r}: not UTF-8 text (byte {exc.start}); give a TOML or JSON cluster "
                           "file (docs/cluster.md)") from None
    return parse_cluster(body, fmt=path.suffix.lower().lstrip("."), where=str(path))


def parse_cluster(text: str, *, fmt: str = "toml", where: str = "cluster file") -> Cluster:
    """A cluster from the text of a file in the format above (``fmt``: ``toml`` or ``json``)."""
    try:
        if fmt == "json":
            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except (ValueError, UnicodeError) as exc:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        detail = " ".join(str(exc).split())
        raise ClusterError(f"{where}: not valid {fmt.upper()} ({detail}); fix the syntax (docs/cluster.md)") from None
    if not isinstance(data, dict):
        raise ClusterError(f"{where}: the top level must be a table of keys; see docs/cluster.md")
    return cluster_from_dict(data, where=where)


_KEYS = ("gpus_per_node", "intra_node", "inter_node", "nics_per_node", "device",
         "name", "source", "nvls", "backend", "nodes", "shared_host", "rank_order")
_LINK_KEYS = ("bandwidth_GBps", "latency_us")
_DEVICE_KEYS = ("name", "peak_tflops", "memory_GiB")


def cluster_from_dict(data: Mapping[str, Any], *, where: str = "cluster file") -> Cluster:
    """A cluster from the keys of a file (one-line :class:`ClusterError` for any mistake)."""
    _known(data, _KEYS, where, "")
    nodes = data.get("nodes")
    return Cluster(
        name=_text(data.get("name", Path(where).stem if where != "cluster file" else "custom"), "name", where),
        source=_text(data.get("source", f"user file {where}"), "source", where),
        gpus_per_node=_count(data, "gpus_per_node", where),
        intra_node=_link(data, "intra_node", where),
        inter_node=_link(data, "inter_node", where),
        nics_per_node=_count(data, "nics_per_node", where),
        device=_device(data, where),
        nvls=_flag(data.get("nvls", False), "nvls", where),
        backend=_backend(data.get("backend", "nccl"), f"{where}: backend"),
        num_nodes=None if nodes is None else _count(data, "nodes", where),
        shared_host=_flag(data.get("shared_host", False), "shared_host", where),
        rank_order=_rank_order(data.get("rank_order", "block"), where),
    )


RANK_ORDERS = ("block", "cyclic")
"""How a launcher numbers ranks over nodes (:mod:`ppsim.step.placement`)."""


def _rank_order(value: Any, where: str) -> str:
    if value not in RANK_ORDERS:
        raise ClusterError(f"{where}: rank_order {value!r}: must be one of {', '.join(RANK_ORDERS)} (block: torchrun's "
                           "node-by-node numbering; cyclic: ranks dealt round the nodes); fix the file")
    return str(value)


def _known(data: Mapping[str, Any], keys: tuple[str, ...], where: str, prefix: str) -> None:
    for key in data:
        if key not in keys:
            raise ClusterError(f"{where}: unknown key {prefix + str(key)!r}; the known keys are "
                               f"{', '.join(prefix + k for k in keys)}")


def _missing(where: str, key: str, rule: str) -> ClusterError:
    return ClusterError(f"{where}: {key} is missing; it must be {rule} (docs/cluster.md)")


def _shown(value: Any) -> str:
    """A value for a one-line message (a huge integer cut to its digit count)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _number(value: Any, key: str, where: str, rule: str, low: float, high: float) -> float:
    """A positive number within [low, high] (a value outside is a typo or a unit mistake, never a cluster)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where}: {key} = {_shown(value)}; it must be {rule}; set a positive number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        raise ClusterError(f"{where}: {key} = {_shown(value)}; it must be {rule}; set a positive number")
    if not low <= number <= high:
        raise ClusterError(f"{where}: {key} = {_shown(value)}; it must be {rule}, from {low:g} to {high:g}; check "
                           "the unit (docs/cluster.md)")
    return number


def _count(data: Mapping[str, Any], key: str, where: str) -> int:
    if key not in data:
        raise _missing(where, key, "a positive whole number")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{where}: {key} = {_shown(value)}; it must be a positive whole number; set it to 1 or "
                           "more")
    if value > MAX_COUNT:
        raise ClusterError(f"{where}: {key} = {_shown(value)}; it must be a whole number from 1 to {MAX_COUNT:,}; "
                           "set a real count")
    return value


def _table(data: Mapping[str, Any], key: str, keys: tuple[str, ...], where: str) -> Mapping[str, Any]:
    if key not in data:
        raise _missing(where, key, "a table {" + ", ".join(f"{k} = ..." for k in keys) + "}")
    value = data[key]
    if not isinstance(value, dict):
        raise ClusterError(f"{where}: {key} = {value!r}; it must be a table {{{', '.join(keys)}}}; see "
                           "docs/cluster.md")
    _known(value, keys, where, f"{key}.")
    for k in keys:
        if k not in value and not (key == "device" and k == "name"):
            raise _missing(where, f"{key}.{k}", "a positive number")
    return value


def _link(data: Mapping[str, Any], key: str, where: str) -> Link:
    t = _table(data, key, _LINK_KEYS, where)
    bw = _number(t["bandwidth_GBps"], f"{key}.bandwidth_GBps", where, "positive (GB/s per direction)",
                 *BANDWIDTH_GBPS)
    lat = t["latency_us"]
    rule = f"a latency in microseconds, 0 to {MAX_LATENCY_US:g}"
    if isinstance(lat, bool) or not isinstance(lat, (int, float)):
        raise ClusterError(f"{where}: {key}.latency_us = {_shown(lat)}; it must be {rule}; set a number such as 5")
    too_large = isinstance(lat, int) and abs(lat) > MAX_LATENCY_US  # before float(): 10**400 would overflow
    if too_large or not math.isfinite(lat) or not 0 <= lat <= MAX_LATENCY_US:
        raise ClusterError(f"{where}: {key}.latency_us = {_shown(lat)}; it must be {rule}; set a number such as 5")
    return Link(bw * GB, float(lat) / 1e6)


def _device(data: Mapping[str, Any], where: str) -> Device:
    t = _table(data, "device", _DEVICE_KEYS, where)
    peak = _number(t["peak_tflops"], "device.peak_tflops", where, "positive (dense TFLOP/s)", *PEAK_TFLOPS)
    memory = _number(t["memory_GiB"], "device.memory_GiB", where, "positive (GiB per device)", *MEMORY_GIB)
    return Device(_text(t.get("name", "device"), "device.name", where), peak * 1e12, round(memory * GiB))


def _text(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ClusterError(f"{where}: {key} = {value!r}; it must be a non-empty string; quote a name")
    return value


def _flag(value: Any, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise ClusterError(f"{where}: {key} = {value!r}; it must be true or false; write true or false")
    return value


def _backend(value: Any, where: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in BACKENDS:
        raise ClusterError(f"{where} {value!r}: not a collective backend; choose one of {', '.join(BACKENDS)}")
    return value.strip().lower()
