"""bench/multi_gpu_check.py: its loss comparison, its layout-only chain, and a CPU run of its checks."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def check(import_bench):
    return import_bench("multi_gpu_check")


def losses(values: list[float], start: int = 1) -> list[dict]:
    return [{"iteration": start + i, "loss": value} for i, value in enumerate(values)]


def test_the_worst_relative_loss_difference_fails_a_run_that_logged_other_iterations(check) -> None:
    reference = losses([10.0, 8.0, 6.0])
    assert check.worst_difference(reference, losses([10.0, 8.0, 6.0])) == 0.0
    assert check.worst_difference(reference, losses([10.0, 8.08, 6.03])) == pytest.approx(0.01)
    assert check.worst_difference(reference, losses([10.0, 8.0])) == float("inf")  # stopped early
    assert check.worst_difference([], []) == float("inf")  # nothing logged is no pass


def test_the_layout_only_chain_keeps_the_batch_and_checkpoints_each_layout_change(check) -> None:
    args = check.parse_args(["--device", "cpu", "--iters", "6", "--gbs", "8", "--mbs", "2"])
    steps = check.layout_chain(args)["steps"]
    assert [(s["dp"], s["tp"], s["pp"]) for s in steps] == [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
    assert {(s["gbs"], s["mbs"]) for s in steps} == {(8, 2)}
    assert [s["train_iters"] for s in steps] == [2, 4, 6] and [s["convert"] for s in steps] == [1, 1, 0]
    assert steps[0]["is_initial"] and (steps[2]["load_dp"], steps[2]["load_tp"]) == (1, 2)
    assert args.size == "tiny" and check.parse_args([]).size == "125m"


@pytest.mark.parametrize(
    "argv, message",
    [(["--iters", "4"], "multiple of 3"), (["--gbs", "6"], "--gbs 6"), (["--checks", "dp3"], "unknown dp3")],
)
def test_bad_flags_are_refused_in_one_line(check, argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        check.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiproc
def test_on_a_cpu_the_all_reduce_and_tp2_agree_with_one_process(check, tmp_path) -> None:
    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--checks", "all-reduce,tp2", "--iters", "3", "--workdir", str(tmp_path)]
    assert check.main([*argv, "--out", str(out)]) == 0
    results = json.loads(out.read_text())["checks"]
    assert results["all-reduce"]["ok"] and results["all-reduce"]["backend"] == "gloo"
    assert results["tp2"]["ok"] and results["tp2"]["worst_rel_diff"] <= check.REL_FLOOR["fp32"]


def test_the_runs_share_the_gpus_as_many_at_a_time_as_fit_and_one_too_wide_is_not_run(
    check, monkeypatch, tmp_path
):
    started, waited = [], []

    class Done:
        def wait(self, timeout=None):
            return 0

    def start(config, root, run, args, devices):
        started.append((run.name, devices, [name for name, _ in waited]))
        return Done()

    def finish(run, devices, process, began, root, records):
        waited.append((run.name, devices))
        records[run.name] = []
        return devices

    monkeypatch.setattr(check, "start", start)
    monkeypatch.setattr(check, "finish", finish)
    wanted = [check.Run("one", (1, 1, 1), 2), check.Run("dp2", (2, 1, 1), 2), check.Run("tp2", (1, 2, 1), 2),
              check.Run("chain", None, 2)]  # fmt: skip
    check.train_all(tmp_path, tmp_path, wanted, check.parse_args(["--gpus", "4"]))
    # one and dp2 fit beside each other; tp2 waits for the first to end; the chain for the next.
    assert started == [("one", [0], []), ("dp2", [1, 2], []), ("tp2", [3, 0], ["one"]),
                       ("chain", [1, 2], ["one", "dp2"])]  # fmt: skip
    started.clear()
    records = check.train_all(tmp_path, tmp_path, wanted[:2], check.parse_args(["--gpus", "1"]))
    assert [name for name, _, _ in started] == ["one"] and records["dp2"] == []
    started.clear()
    check.train_all(tmp_path, tmp_path, wanted[:2], check.parse_args(["--device", "cpu"]))
    assert [devices for _, devices, _ in started] == [[], []]  # a CPU: one run at a time, no device list
