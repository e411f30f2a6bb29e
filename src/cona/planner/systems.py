"""Hardware descriptions for the planner: one GPU type and a two-tier network, read from JSON data files.

A system file (``cona/planner/systems/<name>.json``, or any path) holds the GPU's matrix and vector rates per
dtype, an efficiency curve for matrix products (fraction of peak against the GFLOPs of one product), the
memory capacity and bandwidth with an efficiency curve (against the MB one kernel touches), and the network:
GPUs per node, the intra-node bandwidth per GPU and the inter-node bandwidth per node, each with a latency and
an efficiency. Datasheet numbers carry their sources in the file; efficiencies are priors and say so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from cona.errors import PlanError, not_found

SYSTEMS_PACKAGE = "cona.planner"
SYSTEMS_DIR = "systems"


@dataclass(frozen=True, kw_only=True, slots=True)
class EfficiencyCurve:
    """Fraction of a peak rate against an operation's size, interpolated linearly in log(size).

    Sizes below the first point get the first efficiency, above the last point the last one.
    """

    sizes: tuple[float, ...]
    efficiencies: tuple[float, ...]

    def __call__(self, size: np.ndarray | float) -> np.ndarray:
        log_size = np.log10(np.maximum(np.asarray(size, dtype=float), 1e-30))
        return np.interp(log_size, np.log10(self.sizes), self.efficiencies)


@dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    """One accelerator (or, for ``cpu_gloo``, one CPU worker slot)."""

    matrix_tflops: dict[str, float]
    """Dense matrix-engine peak per dtype (tensor cores)."""
    vector_tflops: dict[str, float]
    """Peak of elementwise arithmetic per dtype."""
    matrix_efficiency: EfficiencyCurve
    """Against the GFLOPs of one matrix product."""
    memory_gib: float
    memory_gbps: float
    """Memory bandwidth in GB/s (1e9 bytes)."""
    memory_efficiency: EfficiencyCurve
    """Against the MB (1e6 bytes) one kernel reads and writes."""
    reserved_gib: float
    """Memory the framework holds whatever the model (CUDA context, communicator buffers, fragmentation)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One network tier: bandwidth per direction, per-message latency, achievable share of the bandwidth."""

    bandwidth_gbps: float
    latency_s: float
    efficiency: float


@dataclass(frozen=True, kw_only=True, slots=True)
class System:
    """A cluster of identical nodes of identical GPUs."""

    name: str
    gpu: Gpu
    gpus_per_node: int
    intra_node: Link
    """Per GPU (NVLink, PCIe or loopback)."""
    inter_node: Link
    """Per node: all of the node's GPUs share it (its NICs together)."""
    train_dtype: str | None = None
    """The dtype this system always trains in, whatever is asked (a CPU trains in fp32); None: as asked."""
    asynchronous_dispatch: bool = True
    """The host queues kernels ahead of an accelerator, so a step takes the longer of the host's dispatch
    and the device's work; false for a CPU, which runs what it dispatches (no separate host floor)."""
    comment: str = ""
    sources: tuple[str, ...] = ()

    def resolve_dtype(self, dtype: str) -> str:
        """The dtype training really uses here; PlanError when the system has no rate for it."""
        used = self.train_dtype or dtype
        if used not in self.gpu.matrix_tflops:
            known = ", ".join(sorted(self.gpu.matrix_tflops))
            raise PlanError(f"system {self.name} has no {used} rate (it has: {known})")
        return used


def devices_mismatch(system: System, device_type: str, gpu_names: Sequence[str] = ()) -> str | None:
    """Why ``system`` does not describe the devices a run is on (None: it does, or nothing tells), in one
    line: a CPU system (no asynchronous dispatch) for a GPU run or a GPU system for a CPU run, or a shipped
    GPU system whose GPU (its name's first part, ``a100`` of ``a100_80g_2gpu_node``) is not in the name of
    this node's GPUs (``gpu_names``: empty when unknown). Its predictions would be another machine's."""
    cpu_system = not system.asynchronous_dispatch
    if device_type == "cpu" and not cpu_system:
        return (
            f"--system {system.name} describes GPUs, but this run trains on the CPU: its predictions are for "
            f"another machine (--system cpu_gloo describes CPU workers)"
        )
    if device_type == "cuda" and cpu_system:
        return (
            f"--system {system.name} describes CPU workers, but this run trains on GPUs (cona systems lists "
            f"GPU systems)"
        )
    gpu = system.name.split("_")[0]
    shipped = system.name in available_systems()
    if device_type == "cuda" and shipped and gpu_names and not any(gpu in name.lower() for name in gpu_names):
        return (
            f"--system {system.name} describes {gpu.upper()} GPUs, but this node has "
            f"{', '.join(sorted(set(gpu_names)))}: its predictions are for another machine (cona systems "
            f"lists them)"
        )
    return None


def available_systems() -> list[str]:
    """Names of the system files shipped with CONA."""
    folder = resources.files(SYSTEMS_PACKAGE).joinpath(SYSTEMS_DIR)
    return sorted(
        entry.name.removesuffix(".json") for entry in folder.iterdir() if entry.name.endswith(".json")
    )


def load_system(name_or_path: str) -> System:
    """A shipped system by name (``a100_80g``) or a system file by path (anything ending in ``.json``)."""
    if name_or_path.endswith(".json") or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise PlanError(f"--system: system file {path} {not_found(path)}")
        text = path.read_bytes().decode("utf-8", errors="replace")  # a non-UTF-8 file: "not valid JSON"
        return parse_system(_read_json(text, str(path)), source=str(path))
    if name_or_path not in available_systems():
        raise PlanError(
            f"--system: unknown system '{name_or_path}'; available: {', '.join(available_systems())}"
        )
    resource = resources.files(SYSTEMS_PACKAGE).joinpath(SYSTEMS_DIR).joinpath(f"{name_or_path}.json")
    return parse_system(_read_json(resource.read_text(), name_or_path), source=name_or_path)


def _read_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanError(f"system {where}: not valid JSON: {err.msg} at line {err.lineno}") from None


def parse_system(raw: Any, *, source: str) -> System:
    """Validate a decoded system file; every error names the file and the key."""
    reader = _Reader(source)
    top = reader.section(
        raw, "", ("name", "comment", "sources", "gpu", "network", "train_dtype", "asynchronous_dispatch")
    )
    gpu_raw = reader.section(
        top.get("gpu"),
        "gpu",
        (
            "matrix_tflops",
            "vector_tflops",
            "matrix_efficiency",
            "memory_gib",
            "memory_gbps",
            "memory_efficiency",
            "reserved_gib",
        ),
    )
    net_raw = reader.section(top.get("network"), "network", ("gpus_per_node", "intra_node", "inter_node"))
    gpu = Gpu(
        matrix_tflops=reader.rates(gpu_raw, "gpu.matrix_tflops"),
        vector_tflops=reader.rates(gpu_raw, "gpu.vector_tflops"),
        matrix_efficiency=reader.curve(gpu_raw, "gpu.matrix_efficiency"),
        memory_gib=reader.positive(gpu_raw, "gpu.memory_gib"),
        memory_gbps=reader.positive(gpu_raw, "gpu.memory_gbps"),
        memory_efficiency=reader.curve(gpu_raw, "gpu.memory_efficiency"),
        reserved_gib=reader.positive(gpu_raw, "gpu.reserved_gib", allow_zero=True),
    )
    if gpu.reserved_gib >= gpu.memory_gib:
        raise reader.fail("gpu.reserved_gib", f"leaves nothing of gpu.memory_gib ({gpu.memory_gib:g})")
    if set(gpu.vector_tflops) != set(gpu.matrix_tflops):
        raise reader.fail(
            "gpu.vector_tflops", "needs a rate for each dtype of gpu.matrix_tflops, and no other"
        )
    gpus_per_node = reader.positive(net_raw, "network.gpus_per_node")
    if gpus_per_node != int(gpus_per_node):
        raise PlanError(f"system {source}: network.gpus_per_node must be an integer")
    dtype = top.get("train_dtype")
    if dtype is not None and dtype not in gpu.matrix_tflops:
        raise PlanError(f"system {source}: train_dtype {dtype!r} has no gpu.matrix_tflops entry")
    asynchronous = top.get("asynchronous_dispatch", True)
    if not isinstance(asynchronous, bool):
        raise PlanError(f"system {source}: asynchronous_dispatch must be true or false")
    sources = top.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise PlanError(f"system {source}: sources must be a list of strings")
    return System(
        name=str(top.get("name") or Path(source).stem),
        gpu=gpu,
        gpus_per_node=int(gpus_per_node),
        intra_node=reader.link(net_raw, "network.intra_node"),
        inter_node=reader.link(net_raw, "network.inter_node"),
        train_dtype=dtype,
        asynchronous_dispatch=asynchronous,
        comment=str(top.get("comment", "")),
        sources=tuple(sources),
    )


@dataclass(frozen=True, slots=True)
class _Reader:
    """Typed access to the parts of one system file, raising PlanError that names the file and key."""

    source: str

    def fail(self, key: str, why: str) -> PlanError:
        return PlanError(f"system {self.source}: {key}: {why}")

    def section(self, raw: Any, key: str, known: tuple[str, ...]) -> dict:
        if not isinstance(raw, dict):
            raise self.fail(key or "<top level>", "must be an object")
        for name in raw:
            if name not in known:
                raise self.fail(
                    f"{key}.{name}" if key else name, f"unknown key; expected one of {', '.join(known)}"
                )
        return raw

    def positive(self, section: dict, key: str, *, allow_zero: bool = False) -> float:
        value = section.get(key.rsplit(".", 1)[-1])
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, "must be a number")
        if value < 0 or (value == 0 and not allow_zero):
            raise self.fail(key, "must be positive")
        return float(value)

    def rates(self, section: dict, key: str) -> dict[str, float]:
        raw = section.get(key.rsplit(".", 1)[-1])
        if not isinstance(raw, dict) or not raw:
            raise self.fail(key, "must be an object of dtype -> TFLOP/s")
        return {dtype: self.positive(raw, f"{key}.{dtype}") for dtype in raw}

    def curve(self, section: dict, key: str) -> EfficiencyCurve:
        raw = section.get(key.rsplit(".", 1)[-1])
        pairs_ok = (
            isinstance(raw, list)
            and raw
            and all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(v, int | float) for v in p)
                for p in raw
            )
        )
        if not pairs_ok:
            raise self.fail(key, "must be a list of [size, efficiency] pairs")
        sizes = tuple(float(p[0]) for p in raw)
        efficiencies = tuple(float(p[1]) for p in raw)
        if any(s <= 0 for s in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise self.fail(key, "sizes must be positive and increasing")
        if any(not 0 < e <= 1 for e in efficiencies):
            raise self.fail(key, "efficiencies must be in (0, 1]")
        return EfficiencyCurve(sizes=sizes, efficiencies=efficiencies)

    def link(self, section: dict, key: str) -> Link:
        raw = self.section(
            section.get(key.rsplit(".", 1)[-1]), key, ("bandwidth_gbps", "latency_s", "efficiency")
        )
        efficiency = self.positive(raw, f"{key}.efficiency")
        if efficiency > 1:
            raise self.fail(f"{key}.efficiency", "must be at most 1")
        return Link(
            bandwidth_gbps=self.positive(raw, f"{key}.bandwidth_gbps"),
            latency_s=self.positive(raw, f"{key}.latency_s", allow_zero=True),
            efficiency=efficiency,
        )


def group_bandwidth(system: System, size: np.ndarray, stride: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Achievable bandwidth (bytes/s per GPU) and per-hop latency of a process group, as arrays.

    Ranks are laid out tp fastest, then dp, then pp, so a group of ``size`` ranks ``stride`` apart stays in
    one node when ``size * stride <= gpus_per_node``. A group spanning nodes is limited by the node's network,
    shared by the ``gpus_per_node / members_per_node`` groups of the same kind that cross it at the same time.
    """
    size, stride = np.asarray(size, dtype=float), np.asarray(stride, dtype=float)
    per_node = system.gpus_per_node
    intra = system.intra_node.bandwidth_gbps * 1e9 * system.intra_node.efficiency
    members_per_node = np.clip(np.floor(per_node / stride), 1.0, size)
    inter = (
        system.inter_node.bandwidth_gbps * 1e9 * system.inter_node.efficiency * members_per_node / per_node
    )
    spans_nodes = size * stride > per_node
    bandwidth = np.where(spans_nodes, np.minimum(intra, inter), intra)
    latency = np.where(spans_nodes, system.inter_node.latency_s, system.intra_node.latency_s)
    return bandwidth, latency


def all_reduce_time(
    nbytes: np.ndarray, size: np.ndarray, bandwidth: np.ndarray, latency: np.ndarray
) -> np.ndarray:
    """Ring all-reduce: ``2(n-1)`` hops, each moving ``nbytes / n``; zero for a group of one."""
    size = np.asarray(size, dtype=float)
    return 2.0 * (size - 1.0) * (latency + np.asarray(nbytes) / size / bandwidth)


def all_gather_time(
    nbytes: np.ndarray, size: np.ndarray, bandwidth: np.ndarray, latency: np.ndarray
) -> np.ndarray:
    """Ring all-gather (or reduce-scatter) of a ``nbytes`` result: ``n-1`` hops of ``nbytes / n``."""
    size = np.asarray(size, dtype=float)
    return (size - 1.0) * (latency + np.asarray(nbytes) / size / bandwidth)
