"""Multi-node placement (hostfile, flags, Slurm), the store protocol between the nodes' runners, and the ssh
command line. Everything here runs in one process; test_multinode_e2e.py beside it runs real nodes."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from tests.helpers.chain_fakes import chain_run, write_fake_chain_config
from tests.helpers.torchrun_util import free_port

from cona.cli import main
from cona.errors import LaunchError
from cona.runner.nodes import multinode
from cona.runner.nodes.multinode import (
    NodePlacement,
    RemoteRunners,
    expand_nodelist,
    parse_hostfile,
    resolve_placement,
)
from cona.runner.nodes.multinode_sync import Coordinator, follow
from cona.runner.run_descriptions import runner_command

TWO_HOSTS = "127.0.0.1 slots=2\n127.0.0.2 slots=2\n"


def hostfile(tmp_path: Path, text: str = TWO_HOSTS) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def placement(tmp_path: Path, text: str = TWO_HOSTS, env: dict | None = None, **flags) -> NodePlacement:
    options = {"hostfile": hostfile(tmp_path, text), "gpus_per_node": 2, **flags}
    return resolve_placement(options, env or {})


# ---------------------------------------------------------------- hostfile


def test_hostfile_with_comments_and_blank_lines(tmp_path):
    text = "# the cluster\n\n1.2.3.4 slots=4  # first\n   1.2.3.5   slots=4\n\n1.2.3.6 slots=4\n"
    assert parse_hostfile(hostfile(tmp_path, text)) == (("1.2.3.4", 4), ("1.2.3.5", 4), ("1.2.3.6", 4))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=2\nb slots=2\na slots=2\n", r"hostfile:3: host a is listed twice \(first on line 1\)"),
        ("a slots=2\n\nb slot=2\n", r"hostfile:3: expected '<host> slots=<n>', got 'b slot=2'"),
        ("a slots=2\nb\n", r"hostfile:2: expected '<host> slots=<n>', got 'b'"),
        ("a slots=2 extra\n", r"hostfile:1: expected '<host> slots=<n>'"),
        ("a slots=0\n", r"hostfile:1: slots must be positive, got 0"),
        ("a slots=2\n-oProxyCommand=x slots=2\n", r"hostfile:2: host '-oProxyCommand=x' starts with '-'"),
        ("# nobody\n\n", r"hostfile: lists no hosts"),
    ],
)
def test_bad_hostfiles_name_the_file_and_line(tmp_path, text, message):
    with pytest.raises(LaunchError, match=message):
        parse_hostfile(hostfile(tmp_path, text))


def test_a_missing_hostfile_is_named(tmp_path):
    with pytest.raises(LaunchError, match=r"--hostfile .*nope: cannot read it"):
        parse_hostfile(tmp_path / "nope")


# ---------------------------------------------------------------- flags


def test_no_ssh_nodes_take_their_rank_and_the_master_comes_first(tmp_path):
    text = "127.0.0.2 slots=2\n127.0.0.1 slots=2\n127.0.0.3 slots=2\n"
    node = placement(tmp_path, text, master_addr="127.0.0.1", no_ssh=True, node_rank=2)
    assert node.hosts == ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    assert (node.num_nodes, node.gpus_per_node, node.node_rank, node.ssh) == (3, 2, 2, False)
    assert node.label(2) == "node 2 (127.0.0.3)"
    assert node.hostfile == (tmp_path / "hostfile").resolve()


def test_without_no_ssh_this_is_node_0_and_starts_the_others(tmp_path):
    node = placement(tmp_path, num_nodes=2)
    assert (node.node_rank, node.ssh, node.master_addr) == (0, True, "127.0.0.1")


def test_gpus_per_node_defaults_to_the_slots(tmp_path):
    node = resolve_placement({"hostfile": hostfile(tmp_path), "no_ssh": True, "node_rank": 1}, {})
    assert (node.num_nodes, node.gpus_per_node) == (2, 2)


def test_one_node_needs_no_placement():
    assert resolve_placement({"gpus": 4}, {}) == NodePlacement(gpus_per_node=4)
    assert resolve_placement({"num_nodes": 1, "gpus_per_node": 4}, {}).num_nodes == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"gpus_per_node": 4}, r"hostfile: 127.0.0.1 has slots=2, but --gpus-per-node is 4"),
        (
            {"master_addr": "10.0.0.9"},
            r"--master-addr 10.0.0.9 is not one of the hosts: 127.0.0.1, 127.0.0.2",
        ),
        ({"no_ssh": True, "node_rank": 2}, r"--node-rank 2 is outside 0..1 \(--num-nodes 2\)"),
        ({"no_ssh": True, "node_rank": -1}, r"--node-rank -1 is outside 0..1"),
        ({"node_rank": 1}, r"--node-rank 1 without --no-ssh: node 0 starts the others over ssh"),
        ({"no_ssh": True}, r"--no-ssh needs --node-rank"),
        ({"num_nodes": 3}, r"--num-nodes 3, but .*hostfile lists 2 hosts"),
        ({"gpus": 4}, r"--gpus is the process count of one node; across nodes give --gpus-per-node"),
    ],
)
def test_bad_flag_combinations_are_refused_with_the_flag(tmp_path, flags, message):
    with pytest.raises(LaunchError, match=message):
        placement(tmp_path, **flags)


def test_gpus_with_only_a_hostfile_is_refused(tmp_path):
    with pytest.raises(LaunchError, match=r"--gpus is the process count of one node"):
        resolve_placement({"gpus": 4, "hostfile": hostfile(tmp_path)}, {})


def test_a_fixed_strategy_across_nodes_runs_as_a_one_stage_chain(tmp_path, monkeypatch, tiny_config_file):
    config = tiny_config_file(data="random")
    captured = []
    monkeypatch.setattr(
        "cona.runner.schedules.chain_schedule.run_chain", lambda run, **_: captured.append(run)
    )
    fixed = ["--dp", "2", "--tp", "1", "--pp", "2", "--gbs", "8", "--mbs", "2", "--iters", "6"]
    nodes = ["--num-nodes", "2", "--gpus-per-node", "2", "--hostfile", str(hostfile(tmp_path)), "--no-ssh"]
    argv = ["train", "--config", str(config), "--workdir", str(tmp_path), "--device", "cpu", *fixed, *nodes]
    assert main([*argv, "--node-rank", "1"]) == 0
    (run,) = captured
    assert run.run_dir.name == "fixed-dp2_tp1_pp2_mbs2_gbs8-iters6" and run.world_size == 4
    assert run.chain_path is None and not run.run_dir.exists()  # the chain is built in memory
    (step,) = run.read_chain("fp32").steps
    assert (step.dp, step.tp, step.pp, step.mbs, step.gbs, step.train_iters) == (2, 1, 2, 2, 8, 6)
    assert step.is_initial
    remote = runner_command(run)  # node 0 starts the others' runners with the same strategy flags
    assert remote[remote.index("train") + 1 : remote.index("--workdir")] == fixed


def test_fresh_goes_with_every_mode_a_fixed_strategy_included(capsys):
    assert main(["train", "--fresh", "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--fresh" not in err and "cona train: missing --tp, --pp" in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_nodes": 2, "gpus_per_node": 2}, r"--num-nodes 2 needs --hostfile \(or a Slurm allocation\)"),
        ({"master_addr": "127.0.0.1"}, r"--master-addr is for runs of several nodes"),
        ({"no_ssh": True, "gpus": 2}, r"--no-ssh is for runs of several nodes"),
        ({"num_nodes": 0, "gpus_per_node": 2}, r"--num-nodes must be positive, got 0"),
    ],
)
def test_multi_node_flags_without_a_hostfile_are_refused(options, message):
    with pytest.raises(LaunchError, match=message):
        resolve_placement(options, {})


def test_node_0_must_run_on_the_master(tmp_path):
    text = "192.0.2.1 slots=2\n192.0.2.2 slots=2\n"  # TEST-NET-1: never an address of this machine
    with pytest.raises(LaunchError, match="--master-addr 192.0.2.1 is not an address of this machine"):
        placement(tmp_path, text)
    assert placement(tmp_path, text, no_ssh=True, node_rank=1).master_addr == "192.0.2.1"


# ---------------------------------------------------------------- Slurm


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu[01-03,07],login2", ["gpu01", "gpu02", "gpu03", "gpu07", "login2"]),
        ("node7", ["node7"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("rack1-n[1,3],rack2-n5", ["rack1-n1", "rack1-n3", "rack2-n5"]),
    ],
)
def test_slurm_compact_nodelists(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


SLURM = {
    "SLURM_JOB_ID": "77",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_JOB_NODELIST": "gpu[01-03]",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_NTASKS_PER_NODE": "1",
}


@pytest.fixture
def no_scontrol(monkeypatch):
    monkeypatch.setattr(multinode.shutil, "which", lambda name: None)


def test_slurm_gives_nodes_rank_master_and_gpus(no_scontrol):
    node = resolve_placement({}, SLURM)
    assert (node.num_nodes, node.node_rank, node.master_addr, node.gpus_per_node) == (3, 2, "gpu01", 4)
    assert (node.hosts, node.ssh) == (("gpu01", "gpu02", "gpu03"), False)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"node_rank": 1}, {}, r"--node-rank 1 disagrees with SLURM_NODEID=2 of the Slurm job"),
        ({"num_nodes": 2}, {}, r"--num-nodes 2 disagrees with SLURM_NNODES=3"),
        ({"gpus_per_node": 8}, {}, r"--gpus-per-node 8 disagrees with SLURM_GPUS_ON_NODE=4"),
        ({}, {"SLURM_NTASKS_PER_NODE": "4"}, r"SLURM_NTASKS_PER_NODE=4: start one cona per node"),
        ({}, {"SLURM_GPUS_ON_NODE": ""}, r"--num-nodes needs --gpus-per-node"),
        ({}, {"SLURM_NODEID": None, "SLURM_PROCID": None}, r"SLURM_NODEID and SLURM_JOB_NODELIST are needed"),
        (
            {"gpus": 4},
            {},
            r"--gpus is the process count of one node; in a Slurm job .* drop it",
        ),
    ],
)
def test_slurm_conflicts_are_refused(no_scontrol, flags, env, message):
    full = {key: value for key, value in {**SLURM, **env}.items() if value is not None}
    with pytest.raises(LaunchError, match=message):
        resolve_placement(flags, full)


# ---------------------------------------------------------------- the store protocol between the runners

TWO_NODES = NodePlacement(num_nodes=2, gpus_per_node=2, hosts=("h0", "h1"))
FOLLOWER = NodePlacement(num_nodes=2, gpus_per_node=2, node_rank=1, hosts=("h0", "h1"))


@pytest.fixture
def port() -> int:
    """A port for the runners' store, free right now."""
    return free_port()


class Follower(threading.Thread):
    """Node 1's runner in a thread, recording the stages it ran (or the error it stopped with)."""

    def __init__(self, port: int, *, fail_stage: int | None = None, timeout_s: float = 5.0):
        super().__init__(daemon=True)
        self.port, self.fail_stage, self.timeout_s = port, fail_stage, timeout_s
        self.ran: list[tuple[int, str, int]] = []
        self.error: Exception | None = None

    def run_local(self, stage, spec_path, port, watch):
        watch()
        if stage == self.fail_stage:
            raise LaunchError("stage 2: rank 3 failed: RuntimeError: boom")
        self.ran.append((stage, spec_path.name, port))

    def run(self):
        try:
            follow(FOLLOWER, port=self.port, timeout_s=self.timeout_s, run_local=self.run_local, out=print)
        except LaunchError as err:
            self.error = err


def test_nodes_agree_on_every_stage_and_node_0_waits_for_every_report(tmp_path, port):
    follower = Follower(port)
    follower.start()
    lines: list[str] = []
    with Coordinator(TWO_NODES, port=port, timeout_s=5.0, out=lines.append) as coordinator:
        for stage in (1, 2):
            coordinator.run_stage(stage, tmp_path / f"spec{stage}.json", 29400 + stage, lambda watch: watch())
            assert (stage, f"spec{stage}.json", 29400 + stage) in follower.ran  # it reported leaving
    follower.join(timeout=5)
    assert not follower.is_alive() and follower.error is None
    assert follower.ran == [(1, "spec1.json", 29401), (2, "spec2.json", 29402)]
    assert lines == ["all 2 nodes joined: h0, h1"]


def test_a_failing_node_stops_every_node_and_is_named(tmp_path, port):
    follower = Follower(port, fail_stage=2)
    follower.start()
    with (
        pytest.raises(LaunchError, match=r"stage 2: node 1 \(h1\) failed: stage 2: rank 3 failed: Runtime"),
        Coordinator(TWO_NODES, port=port, timeout_s=5.0, out=print) as coordinator,
    ):
        coordinator.run_stage(1, tmp_path / "spec1.json", 29401, lambda watch: watch())

        def local(watch):
            while True:  # this node's workers would run on; the watch stops them
                watch()

        coordinator.run_stage(2, tmp_path / "spec2.json", 29402, local)
    follower.join(timeout=5)
    assert "rank 3 failed" in str(follower.error)


def test_node_0_abort_stops_the_other_nodes(tmp_path, port):
    follower = Follower(port)
    follower.start()
    with (
        pytest.raises(LaunchError, match="stage 1: rank 0 failed"),
        Coordinator(TWO_NODES, port=port, timeout_s=5.0, out=print) as coordinator,
    ):

        def local(watch):
            raise LaunchError("stage 1: rank 0 failed: DataError: short file")

        coordinator.run_stage(1, tmp_path / "spec1.json", 29401, local)
    follower.join(timeout=5)
    assert "node 0 (h0) stopped the run: stage 1: rank 0 failed: DataError" in str(follower.error)


def test_a_node_that_never_starts_is_named_after_the_timeout(port):
    with (
        pytest.raises(LaunchError, match=r"node 1 \(h1\) did not start within 2 s .* --node-rank"),
        Coordinator(TWO_NODES, port=port, timeout_s=2.0, out=print),
    ):
        pass


def test_a_node_whose_report_never_comes_is_named(tmp_path, port):
    follower = Follower(port, timeout_s=30.0)
    follower.run_local = lambda stage, spec_path, port, watch: threading.Event().wait(60)  # hangs
    follower.start()
    with (
        pytest.raises(LaunchError, match=r"stage 1: node 1 \(h1\) did not report leaving training within"),
        Coordinator(TWO_NODES, port=port, timeout_s=2.0, out=print) as coordinator,
    ):
        coordinator.run_stage(1, tmp_path / "spec1.json", 29401, lambda watch: None)


def test_a_follower_without_node_0_is_told_so(port):
    follower = Follower(port, timeout_s=1.0)
    follower.run()
    assert "node 0 (h0) did not gather the nodes within" in str(follower.error)


# ---------------------------------------------------------------- ssh


def test_ssh_command_keeps_cwd_environment_and_gives_the_rank(tmp_path):
    env = {"PATH": "/bin", "NCCL_DEBUG": "INFO", "SECRET_TOKEN": "x", "CONA_SSH_OPTIONS": "-p 2222"}
    runners = RemoteRunners(
        TWO_NODES, ["python", "-m", "cona", "train", "--chain", "c d.json"], cwd=tmp_path, env=env, out=print
    )
    command = runners.ssh_command(1)
    assert command[:7] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "--", "h1"]
    script = command[7]
    assert script.startswith(f"cd {tmp_path} && exec env ")
    assert "NCCL_DEBUG=INFO" in script and "PATH=/bin" in script and "SECRET" not in script
    assert script.endswith("--chain 'c d.json' --no-ssh --node-rank 1")


def test_ssh_never_reads_a_host_as_an_option(tmp_path):
    placement = dataclasses.replace(TWO_NODES, hosts=("h0", "-oProxyCommand=touch /tmp/pwned"))
    command = RemoteRunners(placement, ["cona"], cwd=tmp_path, env={}, out=print).ssh_command(1)
    assert command.index("--") == command.index("-oProxyCommand=touch /tmp/pwned") - 1


def test_runner_command_repeats_this_run_for_the_other_nodes(tmp_path):
    write_fake_chain_config(tmp_path)
    nodes = dataclasses.replace(TWO_NODES, hostfile=tmp_path / "hostfile", master_addr="h0")
    run = dataclasses.replace(chain_run(tmp_path, tmp_path / "chain.json"), nodes=nodes, quiet=True)
    command = runner_command(run)
    assert command[1:4] == ["-m", "cona", "train"] and command[-1] == "--quiet"
    flags = dict(zip(command[4:-1:2], command[5:-1:2], strict=True))
    assert flags == {
        "--chain": str(tmp_path / "chain.json"),
        "--workdir": str(tmp_path),
        "--run-name": "run",
        "--device": "cpu",
        "--num-nodes": "2",
        "--gpus-per-node": "2",
        "--master-addr": "h0",
        "--master-port-base": "29400",
        "--config": str(tmp_path / ".conaconfig"),
        "--hostfile": str(tmp_path / "hostfile"),
    }
