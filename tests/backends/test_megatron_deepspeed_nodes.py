"""A Megatron-DeepSpeed stage across nodes: per-node placement, the last rank's lines on every node."""

from __future__ import annotations

import json
import threading

import pytest

from cona.backends.megatron_deepspeed import nodes
from cona.backends.megatron_deepspeed.commands import launcher_command
from cona.backends.megatron_deepspeed.log_parse import MetricsRecorder
from cona.errors import LaunchError
from cona.runner.launch import Topology
from cona.strategy import Strategy

LAST_RANK_LINES = """\
cona gns | iteration 4 | small sqr: 2.0E-01 | big sqr: 1.0E-01 | small batch: 1 | big batch: 2 | measured steps: 2
 iteration        4/      24 | consumed samples:           8 | consumed tokens:          512 | elapsed time per iteration (ms): 400.0 | learning rate: 1.0E-03 | global batch size:     2 | lm loss: 1.05E+01 |
cona stop | iteration 4 | consumed samples: 8 | consumed tokens: 512 | reason: switch_requested
 validation loss at iteration 4 on 4-sample draw from test set | lm loss value: 1.06E+01 | lm loss PPL: 4.0E+04 |
"""  # noqa: E501


def _recorder(lines: str = "") -> MetricsRecorder:
    recorder = MetricsRecorder(stage=1, strategy=Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=2), seq=64,
                               write=lambda record: None, previous_iteration=0)  # fmt: skip
    for line in lines.splitlines():
        recorder.feed(line)
    recorder.flush()
    return recorder


def _topology(rank: int) -> Topology:
    return Topology(nproc_per_node=1, master_port=29777, master_addr="10.0.0.1", nnodes=2, node_rank=rank)


def test_each_node_launches_its_share_with_a_hostfile_and_its_rank(tmp_path):
    placement = nodes.placement(tmp_path, _topology(1))
    command = launcher_command(tmp_path / "deepspeed", placement, tmp_path / "entry.py", ["--x"])
    assert command[1:9] == ["--hostfile", str(tmp_path / "deepspeed_hostfile.node1"), "--no_ssh",
                            "--node_rank", "1", "--num_gpus", "1", "--master_addr"]  # fmt: skip
    assert (tmp_path / "deepspeed_hostfile.node1").read_text() == "node0 slots=1\nnode1 slots=1\n"
    assert nodes.node_file("megatron.log", _topology(1)) == "megatron.node1.log"
    assert nodes.node_file("ds_config.json", _topology(0)) == "ds_config.json"


def test_the_last_nodes_view_reaches_the_other_node(tmp_path):
    log0, log1 = tmp_path / "megatron.log", tmp_path / "megatron.node1.log"
    last = _recorder(LAST_RANK_LINES)
    received = {}

    def node0() -> None:
        received["view"] = nodes.exchange_view(
            log0, _recorder(), _topology(0), succeeded=True, timeout_s=30, stage=1
        )

    waiter = threading.Thread(target=node0)
    waiter.start()
    nodes.forget_view(log1, _topology(1))
    shared = nodes.exchange_view(log1, last, _topology(1), succeeded=True, timeout_s=30, stage=1)
    waiter.join()
    assert json.dumps(received["view"].to_dict()) == json.dumps(shared.to_dict())  # NaN != NaN
    view = received["view"]
    assert view.stop is not None and (view.stop.iteration, view.stop.reason) == (4, "switch_requested")
    assert view.last is not None and view.last["gns_small_sqr"] == pytest.approx(0.2)
    assert [(e.split, e.samples, e.loss) for e in view.evaluations] == [("test", 4, 10.6)]


def test_a_missing_view_is_one_line_naming_the_shared_run_directory(tmp_path):
    with pytest.raises(LaunchError, match="the last node reported nothing within 0 s .*run directory shared"):
        nodes.exchange_view(tmp_path / "verify.log", _recorder(), _topology(0), succeeded=True, timeout_s=0,
                            stage=3)  # fmt: skip
