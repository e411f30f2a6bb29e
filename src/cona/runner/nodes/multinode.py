"""Multi-node runs: where the nodes are, and how their runners agree on every stage boundary.

**Placement.** ``--hostfile`` (DeepSpeed format: ``<host> slots=<n>`` per line, ``#`` comments),
``--num-nodes``, ``--gpus-per-node``, ``--master-addr`` and ``--node-rank``, or inside a Slurm allocation
the ``SLURM_*`` variables, give a :class:`NodePlacement`. Node 0 is the master's host; the other hosts take
ranks 1, 2, ... in hostfile order.

**Start.** Every node runs the same command; the runners agree on every stage boundary through a store
node 0's runner hosts (:mod:`cona.runner.nodes.multinode_sync`). Without ``--no-ssh`` node 0 starts the other
runners over ssh (:class:`RemoteRunners`).
"""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cona.errors import LaunchError

if TYPE_CHECKING:
    from cona.config import ConaConfig

SSH_OPTIONS_ENV = "CONA_SSH_OPTIONS"
"""Extra ssh options for starting the other nodes (shell syntax), e.g. ``-p 2222 -i ~/.ssh/cluster``."""
FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "PYTHON", "CONA_", "OMP_", "UCX_", "WANDB_", "HF_")
FORWARDED_ENV = ("PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
_HOSTFILE_LINE = re.compile(r"(?P<host>\S+)\s+slots=(?P<slots>\d+)")
_NODELIST_PART = re.compile(r"(?P<prefix>[^\[,]+)(?:\[(?P<ranges>[^\]]+)\])?(?:,|$)")


@dataclass(frozen=True, kw_only=True)
class NodePlacement:
    """This node's place in the run."""

    num_nodes: int = 1
    gpus_per_node: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    hosts: tuple[str, ...] = ()
    """Host of each node rank (node 0 is the master's), when a hostfile or Slurm names them."""
    ssh: bool = False
    """Node 0 starts the other nodes' runners over ssh."""
    hostfile: Path | None = None

    def label(self, rank: int) -> str:
        return f"node {rank} ({self.hosts[rank]})" if rank < len(self.hosts) else f"node {rank}"


# ---------------------------------------------------------------- placement: hostfile, flags, Slurm


def parse_hostfile(path: Path) -> tuple[tuple[str, int], ...]:
    """``(host, slots)`` per host line, in file order; malformed lines and duplicate hosts are errors."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise LaunchError(f"--hostfile {path}: cannot read it ({err.strerror})") from None
    except UnicodeDecodeError:
        raise LaunchError(f"--hostfile {path}: not a text file (not valid UTF-8)") from None
    hosts: dict[str, tuple[int, int]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.fullmatch(line)
        if match is None:
            raise LaunchError(f"{path}:{number}: expected '<host> slots=<n>', got {raw.strip()!r}")
        host, slots = match["host"], int(match["slots"])
        if host.startswith("-"):
            raise LaunchError(
                f"{path}:{number}: host {host!r} starts with '-', which ssh would read as an option"
            )
        if slots <= 0:
            raise LaunchError(f"{path}:{number}: slots must be positive, got {slots}")
        if host in hosts:
            raise LaunchError(
                f"{path}:{number}: host {host} is listed twice (first on line {hosts[host][1]})"
            )
        hosts[host] = (slots, number)
    if not hosts:
        raise LaunchError(f"{path}: lists no hosts (one '<host> slots=<n>' per line)")
    return tuple((host, slots) for host, (slots, _) in hosts.items())


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list (``gpu[01-03,07],login2``) as host names, in order."""
    hosts: list[str] = []
    for match in _NODELIST_PART.finditer(nodelist.strip()):
        prefix, ranges = match["prefix"], match["ranges"]
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{number:0{width}d}")
    return hosts


def slurm_hosts(nodelist: str) -> list[str]:
    """The allocation's hosts: ``scontrol show hostnames`` where it is installed, else our own parser."""
    if shutil.which("scontrol"):
        done = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False
        )
        if done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    return expand_nodelist(nodelist)


def resolve_placement(options: Mapping[str, Any], env: Mapping[str, str]) -> NodePlacement:
    """The placement from the flags (``num_nodes``, ``gpus_per_node``, ``gpus``, ``hostfile``,
    ``master_addr``, ``node_rank``, ``no_ssh``) and, inside a Slurm job step, the ``SLURM_*`` variables."""
    given = {key: value for key, value in options.items() if value is not None and value is not False}
    if "gpus" in given and given.keys() & {"num_nodes", "gpus_per_node", "hostfile"}:
        raise LaunchError("--gpus is the process count of one node; across nodes give --gpus-per-node")
    slurm = _slurm_values(env, given) if int(env.get("SLURM_NNODES", "1") or 1) > 1 else {}
    values = {**given, **slurm}
    if "gpus" in given and slurm:
        raise LaunchError("--gpus is the process count of one node; in a Slurm job of several nodes drop it")
    hosts: tuple[str, ...] = tuple(values.get("slurm_hosts", ()))
    if "hostfile" in values:
        listed = parse_hostfile(Path(values["hostfile"]))
        _check_slots(listed, values, Path(values["hostfile"]))
        hosts = tuple(host for host, _ in listed)
    num_nodes = values.get("num_nodes", len(hosts) or 1)
    if num_nodes <= 0:
        raise LaunchError(f"--num-nodes must be positive, got {num_nodes}")
    if num_nodes == 1 and not hosts[1:]:
        stray = [flag for flag in ("master_addr", "node_rank", "no_ssh") if flag in given]
        if stray and not hosts:
            flag = "--" + stray[0].replace("_", "-")
            raise LaunchError(f"{flag} is for runs of several nodes: give --num-nodes and --hostfile")
        if given.get("node_rank", 0) != 0:
            raise LaunchError(f"--node-rank {given['node_rank']} is outside 0..0 (one node)")
        return NodePlacement(gpus_per_node=values.get("gpus_per_node", values.get("gpus", 1)))
    return _multi_node(values, hosts, num_nodes, from_slurm=bool(slurm))


def _multi_node(values: dict, hosts: tuple[str, ...], num_nodes: int, *, from_slurm: bool) -> NodePlacement:
    if not hosts:
        raise LaunchError(
            f"--num-nodes {num_nodes} needs --hostfile (or a Slurm allocation) naming the hosts"
        )
    if len(hosts) != num_nodes:
        raise LaunchError(f"--num-nodes {num_nodes}, but {values.get('hostfile')} lists {len(hosts)} hosts")
    if "gpus_per_node" not in values:
        raise LaunchError("--num-nodes needs --gpus-per-node (or a hostfile's slots)")
    master = values.get("master_addr", hosts[0])
    if master not in hosts:
        raise LaunchError(f"--master-addr {master} is not one of the hosts: {', '.join(hosts)}")
    ssh = not from_slurm and not values.get("no_ssh", False)
    node_rank = values.get("node_rank", 0)
    if ssh and node_rank != 0:
        raise LaunchError(
            f"--node-rank {node_rank} without --no-ssh: node 0 starts the others over ssh; "
            f"pass --no-ssh to start every node by hand"
        )
    if not from_slurm and not ssh and "node_rank" not in values:
        raise LaunchError("--no-ssh needs --node-rank (each node is started by hand with its own rank)")
    if not 0 <= node_rank < num_nodes:
        raise LaunchError(f"--node-rank {node_rank} is outside 0..{num_nodes - 1} (--num-nodes {num_nodes})")
    ordered = (master, *(host for host in hosts if host != master))
    placement = NodePlacement(
        num_nodes=num_nodes,
        gpus_per_node=values["gpus_per_node"],
        node_rank=node_rank,
        master_addr=master,
        hosts=ordered,
        ssh=ssh,
        hostfile=Path(values["hostfile"]).resolve() if "hostfile" in values else None,
    )
    if node_rank == 0:
        check_local_address(master)
    return placement


def _check_slots(listed: Sequence[tuple[str, int]], values: dict, path: Path) -> None:
    per_node = values.get("gpus_per_node")
    for host, slots in listed:
        per_node = slots if per_node is None else per_node
        if slots != per_node:
            raise LaunchError(f"{path}: {host} has slots={slots}, but --gpus-per-node is {per_node}")
    values["gpus_per_node"] = per_node


def _slurm_values(env: Mapping[str, str], given: dict) -> dict[str, Any]:
    """num_nodes, node_rank, master_addr, gpus_per_node and the hosts of a Slurm job step; a flag given
    as well must agree."""
    if int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or 1) != 1:
        raise LaunchError(
            f"SLURM_NTASKS_PER_NODE={env['SLURM_NTASKS_PER_NODE']}: start one cona per node "
            f"(srun --ntasks-per-node=1); it starts the node's processes itself"
        )
    rank = env.get("SLURM_NODEID", env.get("SLURM_PROCID"))
    if rank is None or "SLURM_JOB_NODELIST" not in env:
        raise LaunchError(
            "inside Slurm, SLURM_NODEID and SLURM_JOB_NODELIST are needed: start cona with srun"
        )
    hosts = slurm_hosts(env["SLURM_JOB_NODELIST"])
    found: dict[str, Any] = {"num_nodes": int(env["SLURM_NNODES"]), "node_rank": int(rank)}
    found["master_addr"] = given.get("master_addr", hosts[0])
    if env.get("SLURM_GPUS_ON_NODE"):
        found["gpus_per_node"] = int(env["SLURM_GPUS_ON_NODE"])
    names = {"num_nodes": "SLURM_NNODES", "node_rank": "SLURM_NODEID", "gpus_per_node": "SLURM_GPUS_ON_NODE"}
    for key, variable in names.items():
        if key in given and key in found and given[key] != found[key]:
            flag = "--" + key.replace("_", "-")
            raise LaunchError(f"{flag} {given[key]} disagrees with {variable}={found[key]} of the Slurm job")
    if "hostfile" not in given:
        found["slurm_hosts"] = hosts
    return found


def check_local_address(addr: str) -> None:
    """Node 0 hosts the rendezvous: the master address must be one of this machine's."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((addr, 0))
    except OSError:
        raise LaunchError(
            f"--master-addr {addr} is not an address of this machine; node rank 0 must run on the master"
        ) from None


# ---------------------------------------------------------------- ssh start of the other nodes


def cona_command(
    mode_args: Sequence[str],
    *,
    config: ConaConfig,
    nodes: NodePlacement,
    run_dir: Path,
    workdir: Path,
    base_port: int,
    quiet: bool,
) -> list[str]:
    """The ``cona train`` command node 0 starts on the other hosts: ``mode_args`` (what decides the stages:
    a chain file, the online flags) plus what must be the same on every node (run directory, workdir,
    config, placement)."""
    command = [
        sys.executable, "-m", "cona", "train", *mode_args,
        "--workdir", str(workdir), "--run-name", run_dir.name, "--device", config.training.runtime.device,
        "--num-nodes", str(nodes.num_nodes), "--gpus-per-node", str(nodes.gpus_per_node),
        "--master-addr", nodes.master_addr, "--master-port-base", str(base_port),
    ]  # fmt: skip
    if config.path is not None:
        command += ["--config", str(Path(config.path).resolve())]
    for override in config.overrides:  # the same config on every node
        command += ["--set", override]
    if nodes.hostfile is not None:
        command += ["--hostfile", str(nodes.hostfile)]
    return command + (["--quiet"] if quiet else [])


class RemoteRunners:
    """Node 0 starts the same command on every other host over ssh (``--no-ssh --node-rank r`` added), in
    the same working directory with the forwarded environment; their output is printed prefixed by host."""

    def __init__(
        self,
        placement: NodePlacement,
        command: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        out: Callable[[str], None],
    ) -> None:
        self.placement, self.command, self.cwd, self.env, self.out = placement, list(command), cwd, env, out
        self._procs: dict[int, subprocess.Popen] = {}
        self._threads: list[threading.Thread] = []

    def ssh_command(self, rank: int) -> list[str]:
        forwarded = {
            key: value
            for key, value in self.env.items()
            if key in FORWARDED_ENV or key.startswith(FORWARDED_ENV_PREFIXES)
        }
        remote = [*self.command, "--no-ssh", "--node-rank", str(rank)]
        assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(forwarded.items()))
        script = f"cd {shlex.quote(str(self.cwd))} && exec env {assignments} {shlex.join(remote)}"
        options = shlex.split(self.env.get(SSH_OPTIONS_ENV, ""))
        # "--" ends ssh's options: a host name can never be read as one (the hostfile refuses "-" too).
        return ["ssh", "-o", "BatchMode=yes", *options, "--", self.placement.hosts[rank], script]

    def start(self) -> None:
        for rank in range(1, self.placement.num_nodes):
            host = self.placement.hosts[rank]
            self.out(f"starting {self.placement.label(rank)} over ssh")
            proc = subprocess.Popen(
                self.ssh_command(rank),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            self._procs[rank] = proc
            thread = threading.Thread(target=self._relay, args=(proc, host), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _relay(self, proc: subprocess.Popen, host: str) -> None:
        for line in proc.stdout:
            self.out(f"[{host}] {line.rstrip()}")

    def check(self) -> None:
        """Raise if a remote runner (or its ssh) already exited with an error."""
        for rank, proc in self._procs.items():
            code = proc.poll()
            if code not in (None, 0):
                raise LaunchError(
                    f"{self.placement.label(rank)}: its runner exited with code {code} (ssh "
                    f"{self.placement.hosts[rank]}; {'ssh itself failed; ' if code == 255 else ''}"
                    f"see the lines prefixed [{self.placement.hosts[rank]}])"
                )

    def stop(self, *, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the remote runners to end (node 0's last command tells them to), then
        close the ssh connections that are left."""
        deadline = time.monotonic() + wait_s
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)
