"""Two "nodes" on one machine: two ``cona train --chain`` runners (node ranks 0 and 1, 2 CPU workers each)
sharing a temporary workspace, against the same chain on one node with 4 workers; a killed node, and the
rerun that resumes, in which node 0 starts node 1 over ssh through a real sshd on loopback (127.0.0.2)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers.tiny import write_tiny_config
from tests.helpers.tiny_runs import free_port_base

STAGE2_ITERS = 6
CHAIN = {
    "steps": [
        {"step_num": 1, "dp": 2, "tp": 1, "pp": 2, "gbs": 8, "mbs": 2, "train_iters": 2, "is_initial": True,
         "convert": True},
        {"step_num": 2, "dp": 2, "tp": 2, "pp": 1, "gbs": 8, "mbs": 4, "extra_iters": STAGE2_ITERS},
    ]
}  # fmt: skip
RUN_TIMEOUT_S = 400  # generous: the test machine's 2 cores are shared


def setup(tmp_path: Path) -> Path:
    config_path = write_tiny_config(
        tmp_path,
        data="random",
        training={"log_interval": 1, "eval_interval": 100, "distributed_timeout_minutes": 1},
    )
    (tmp_path / "chain.json").write_text(json.dumps(CHAIN))
    (tmp_path / "hostfile").write_text("# two nodes on loopback\n127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    return config_path


def train_command(tmp_path: Path, run_name: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "cona", "train", "--quiet",
        "--chain", str(tmp_path / "chain.json"), "--config", str(tmp_path / ".conaconfig"),
        "--workdir", str(tmp_path / f"work-{run_name}"), "--run-name", run_name, *extra,
    ]  # fmt: skip


def node_command(tmp_path: Path, rank: int, port_base: int, *extra: str) -> list[str]:
    return train_command(
        tmp_path, "nodes",
        "--num-nodes", "2", "--gpus-per-node", "2", "--hostfile", str(tmp_path / "hostfile"),
        "--master-addr", "127.0.0.1", "--master-port-base", str(port_base), *extra,
        *(["--no-ssh", "--node-rank", str(rank)] if rank >= 0 else []),
    )  # fmt: skip


def start(command: list[str], tmp_path: Path, name: str, **env_vars: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.out", "w")  # noqa: SIM115 (closed with the process by the OS)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_vars}
    return subprocess.Popen(
        command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun puts its workers in sessions of their own, so a process
    group does not reach them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def kill_tree(process: subprocess.Popen) -> None:
    for pid in process_tree(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


@pytest.fixture
def started():
    """Processes a test started; whatever still runs at its end is killed with its workers."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            kill_tree(process)


def output(tmp_path: Path, name: str) -> str:
    return (tmp_path / f"{name}.out").read_text()


def losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of every iteration (a retried stage logs some iterations twice)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["iteration"]: record["loss"] for record in records}


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def metrics_past(run_dir: Path, iteration: int) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and any(
        json.loads(line)["iteration"] > iteration for line in path.read_text().splitlines() if line.strip()
    )


# ---------------------------------------------------------------- ssh


def ssh_options(keys: Path, port: int) -> list[str]:
    return [
        "-p", str(port), "-i", str(keys / "client"), "-o", "StrictHostKeyChecking=no",
        "-o", f"UserKnownHostsFile={keys / 'known_hosts'}", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
    ]  # fmt: skip


def start_sshd(directory: Path) -> tuple[subprocess.Popen | None, str]:
    """An sshd on 127.0.0.2 accepting one fresh key for the current user. Returns it with the value of
    CONA_SSH_OPTIONS that reaches it, or None with the reason it cannot run."""
    sshd, keygen = shutil.which("sshd") or "/usr/sbin/sshd", shutil.which("ssh-keygen")
    if not Path(sshd).is_file() or keygen is None or shutil.which("ssh") is None:
        return None, f"sshd/ssh/ssh-keygen not installed (sshd: {sshd}); apt-get install openssh-server"
    keys = directory / "ssh"
    keys.mkdir(mode=0o700)
    for name in ("host", "client"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    (keys / "authorized_keys").write_text((keys / "client.pub").read_text())
    port = free_port_base() + 1
    config = keys / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.2\nHostKey {keys / 'host'}\n"
        f"AuthorizedKeysFile {keys}/authorized_keys\n"
        f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        f"PidFile {keys / 'sshd.pid'}\nPermitUserEnvironment no\n"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    process = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    probe = ["ssh", *ssh_options(keys, port), "127.0.0.2", "true"]
    deadline = time.monotonic() + 15
    while subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            return None, f"sshd could not start on 127.0.0.2:{port}: {process.communicate()[1][-500:]}"
        time.sleep(0.2)
    return process, " ".join(ssh_options(keys, port))


@pytest.fixture
def sshd(tmp_path):
    """(sshd process or None, CONA_SSH_OPTIONS or the reason there is no sshd); stopped at the end."""
    process, options_or_reason = start_sshd(tmp_path)
    yield process, options_or_reason
    if process is not None:
        process.terminate()
        process.wait()


def test_an_sshd_for_the_ssh_path_can_start(sshd):
    """The e2e test below restarts the nodes over ssh when an sshd can start; this test says when not."""
    process, options_or_reason = sshd
    if process is None:
        print(f"SKIPPED ssh path: {options_or_reason}")
        pytest.skip(options_or_reason)
    assert process.poll() is None


# ---------------------------------------------------------------- two nodes


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_nodes_match_one_node_and_a_killed_node_stops_both_then_rerun_resumes(tmp_path, started, sshd):
    """Two nodes (--no-ssh) train like one; killing node 1 stops node 0 with the node named, nothing is
    published; the rerun (node 0 alone, starting node 1 over ssh, when an sshd can run) resumes."""
    setup(tmp_path)
    reference = start(train_command(tmp_path, "one", "--gpus", "4"), tmp_path, "one")
    started.append(reference)
    assert reference.wait(timeout=RUN_TIMEOUT_S) == 0, output(tmp_path, "one")
    expected = losses(tmp_path / "logs" / "one")
    assert sorted(expected) == list(range(1, 3 + STAGE2_ITERS))

    run_dir, port_base = tmp_path / "logs" / "nodes", free_port_base()
    node0 = start(node_command(tmp_path, 0, port_base), tmp_path, "node0")
    node1 = start(node_command(tmp_path, 1, port_base), tmp_path, "node1")
    started.extend((node0, node1))
    wait_for(lambda: metrics_past(run_dir, 3), RUN_TIMEOUT_S, "stage 2 to train")
    kill_tree(node1)  # the whole node: its runner, torchrun and workers
    killed = time.monotonic()
    assert node0.wait(timeout=75) != 0  # within the 1-minute timeout of the config (and its polling)
    stopped_after = time.monotonic() - killed
    print(f"node 0 stopped {stopped_after:.1f} s after node 1 was killed")
    message = output(tmp_path, "node0").strip().splitlines()[-1]
    assert message.startswith("cona: error: stage 2: ") and "node 1 (127.0.0.2)" in message, message
    assert stopped_after < 70, stopped_after
    state = json.loads((run_dir / "runner_state.json").read_text())
    assert [stage["status"] for stage in state["stages"]] == ["done", "running"]  # nothing more published

    ssh_process, ssh_options_or_reason = sshd
    if ssh_process is not None:
        node0 = start(
            node_command(tmp_path, -1, port_base),
            tmp_path,
            "node0-again",
            CONA_SSH_OPTIONS=ssh_options_or_reason,
        )
        started.append(node0)
        assert node0.wait(timeout=RUN_TIMEOUT_S) == 0, output(tmp_path, "node0-again")
        node1_output = "\n".join(
            line.removeprefix("[127.0.0.2] ")
            for line in output(tmp_path, "node0-again").splitlines()
            if line.startswith("[127.0.0.2] ")
        )
        assert "starting node 1 (127.0.0.2) over ssh" in output(tmp_path, "node0-again")
    else:
        print(f"rerun without ssh: {ssh_options_or_reason}")
        node0 = start(node_command(tmp_path, 0, port_base), tmp_path, "node0-again")
        node1 = start(node_command(tmp_path, 1, port_base), tmp_path, "node1-again")
        started.extend((node0, node1))
        assert node0.wait(timeout=RUN_TIMEOUT_S) == 0, output(tmp_path, "node0-again")
        assert node1.wait(timeout=30) == 0, output(tmp_path, "node1-again")
        node1_output = output(tmp_path, "node1-again")
    resumed = output(tmp_path, "node0-again")
    assert "all 2 nodes joined: 127.0.0.1, 127.0.0.2" in resumed
    assert "resuming run nodes at stage 2 (running) from " in resumed and "global_step2_universal" in resumed
    assert "node 1 (127.0.0.2) joined the run of node 0 (127.0.0.1)" in node1_output
    assert "node 0 (127.0.0.1) finished the run" in node1_output
    assert (run_dir / "stages" / "2" / "torchrun.node1.log").is_file()
    got = losses(run_dir)
    assert sorted(got) == sorted(expected)
    print(f"largest loss difference: {max(abs(got[i] - expected[i]) for i in expected):.3g}")
    for iteration, loss in expected.items():
        assert got[iteration] == pytest.approx(loss, rel=1e-5, abs=1e-6), iteration
