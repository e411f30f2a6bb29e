"""``cona plan`` on a small recorded trace: a metrics.jsonl as the engine writes it, 4 CPU processes."""

from __future__ import annotations

import json
import math

import pytest

from cona.cli import main
from cona.config.file import load_config
from cona.runner.chain_file import load_chain

CONFIG = {
    "model": {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab_size": 256},
    "training": {"base_gbs": 4, "dtype": "fp32", "probe_tokens": 1024},  # probes short next to the trace
}
STAGES = ({"dp": 4, "tp": 1, "pp": 1, "mbs": 1, "gbs": 4}, {"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 8})
SWITCH_GAP_S = 5.0


def metrics_rows(iterations: int = 500, stages: int = 1) -> list[dict]:
    """Rows of a run whose noise scale grows from 2 to ~380 samples as the loss falls from 6 to 2.5;
    with two stages, the second starts at gbs 8 after a SWITCH_GAP_S pause."""
    rows, tokens, clock = [], 0, 1000.0
    for iteration in range(1, iterations + 1):
        stage = 1 if stages == 1 or iteration <= iterations // 2 else 2
        layout = STAGES[stage - 1]
        step_time = 0.02 * layout["mbs"] + 0.01
        if stage == 2 and iteration == iterations // 2 + 1:
            clock += SWITCH_GAP_S
        tokens += layout["gbs"] * CONFIG["model"]["seq"]
        clock += step_time
        fraction = iteration / iterations
        loss = 2.5 + 3.5 * (1 - fraction) ** 2
        noise_scale, grad_sqr = 2.0 * (6.0 / loss) ** 6, 1.0
        small, big = 1, layout["gbs"]
        rows.append(
            {
                "stage": stage,
                "iteration": iteration,
                "consumed_samples": tokens // 32,
                "consumed_tokens": tokens,
                "loss": loss,
                **layout,
                "step_time_s": step_time,
                "tokens_per_s": layout["gbs"] * 32 / step_time,
                "time": clock,
                "gns_small_sqr": grad_sqr + noise_scale * grad_sqr / small,
                "gns_big_sqr": grad_sqr + noise_scale * grad_sqr / big,
                "gns_small_batch": small,
                "gns_big_batch": big,
            }
        )
    return rows


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / ".conaconfig").write_text(json.dumps(CONFIG))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_run(project, rows):
    run = project / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


BASE_ARGS = ["plan", "--system", "cpu_gloo", "--max-gbs", "32", "--no-botorch", "--segments", "60"]


def test_plan_writes_a_chain_that_the_runner_accepts(project, capsys):
    run = write_run(project, metrics_rows())
    code = main(
        [*BASE_ARGS, "--trace", str(run), "--target-loss", "2.6", "--switch-cost-s", "0.5", "--out", "c.json"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    for label in ("static gbs 4", "static gbs 32", "hindsight optimum", "CONA online", "1 strategy at the"):
        assert label in out
    chain = load_chain(project / "c.json", config=load_config(), world_size=4, dtype="fp32", workdir=project)
    assert chain.steps[0].gbs == 4
    assert len(chain.steps) >= 2  # the noise scale grows 190-fold: CONA leaves gbs 4
    assert [step.gbs for step in chain.steps] == sorted(step.gbs for step in chain.steps)


def test_the_switch_cost_is_measured_at_the_trace_s_stage_change(project, capsys):
    run = write_run(project, metrics_rows(stages=2))
    assert main([*BASE_ARGS, "--trace", str(run / "metrics.jsonl"), "--out", "c.json"]) == 0
    out = capsys.readouterr().out
    cost = float(out.split("switch cost ")[1].split(" s")[0])
    assert cost == pytest.approx(SWITCH_GAP_S, abs=0.05)


def test_a_perplexity_target_is_its_log_loss(project, capsys):
    run = write_run(project, metrics_rows())
    args = [*BASE_ARGS, "--trace", str(run), "--switch-cost-s", "0.5", "--out", "c.json"]
    assert main([*args, "--target-ppl", f"{math.exp(3.0):.6f}"]) == 0
    assert "target loss 3, reached at" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message", "code"),  # 2: a usage error (flags), 1: what the planner refuses of the trace
    [
        (["--target-loss", "1.0"], "never reaches the target 1", 1),
        (["--total-tokens", "1e12"], "--total-tokens / --total-iters", 1),
        (["--target-ppl", "0.5"], "--target-ppl must be above 1", 2),
        ([], "--switch-cost-s", 2),
        (["--initial-gbs", "64"], "--max-gbs: 32 is below the initial gbs 64", 2),
    ],
)
def test_bad_inputs_are_one_line_errors(project, capsys, extra, message, code):
    run = write_run(project, metrics_rows())
    cost = [] if not extra else ["--switch-cost-s", "1"]
    assert main([*BASE_ARGS, "--trace", str(run), *cost, *extra, "--out", "c.json"]) == code
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (project / "c.json").exists()


def test_an_unwritable_out_names_the_flag(project, capsys):
    run = write_run(project, metrics_rows())
    args = [*BASE_ARGS, "--trace", str(run), "--switch-cost-s", "1", "--out", str(project / "no" / "c.json")]
    assert main(args) == 1
    assert "--out: cannot write" in capsys.readouterr().err


def test_a_missing_trace_names_the_flag(project, capsys):
    assert (
        main([*BASE_ARGS, "--trace", str(project / "nowhere"), "--switch-cost-s", "1", "--out", "c.json"])
        == 1
    )
    assert "--trace" in capsys.readouterr().err


def test_the_strategies_the_trace_trained_are_planned_at_their_measured_throughput(project, capsys):
    """The estimator online mode uses: measured where the trace has it (here off the model by 10-90%)."""
    run = write_run(project, metrics_rows(stages=2))
    assert main([*BASE_ARGS, "--trace", str(run), "--out", "c.json"]) == 0
    out = capsys.readouterr().out
    for layout in STAGES:
        rate = layout["gbs"] * CONFIG["model"]["seq"] / (0.02 * layout["mbs"] + 0.01)
        line = next(line for line in out.splitlines() if f"mbs{layout['mbs']} gbs{layout['gbs']} " in line)
        assert line.endswith(f"{rate:,.0f} tokens/s (measured)"), line
    assert "2 strategies at the measured throughput" in out
