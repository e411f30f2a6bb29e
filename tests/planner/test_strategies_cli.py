import functools
import json

import pytest

from cona.cli import main
from cona.planner import search
from cona.planner.systems import load_system

MODEL = {"name": "gpt-1.3b", "layers": 24, "hidden": 2048, "heads": 16, "seq": 2048, "vocab_size": 50257}


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / ".conaconfig"
    path.write_text(json.dumps({"model": MODEL, "training": {"dtype": "bf16"}}))
    return path


def run_json(capsys, *args):
    assert main(["strategies", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_ranking_matches_the_exhaustive_search(capsys, config_path):
    out = run_json(
        capsys,
        "--gpus",
        "16",
        "--system",
        "a100_80g",
        "--gbs",
        "128",
        "--config",
        str(config_path),
        "--top",
        "4",
        "--no-botorch",
    )
    assert out["method"] == "exhaustive" and out["evaluations"] == out["space_size"] > 0
    rows = out["candidates"]
    assert [row["rank"] for row in rows] == [1, 2, 3, 4]
    times = [row["iteration_time_s"] for row in rows]
    assert times == sorted(times)
    assert all(row["dp"] * row["tp"] * row["pp"] == 16 and row["gbs"] == 128 for row in rows)
    assert all(not row["oom"] and row["memory_per_gpu_gib"] == row["memory_gib"] for row in rows)
    from cona.config.file import load_config

    expected = search.exhaustive_search(
        load_config(config_path).model, load_system("a100_80g"), 16, 128, top_k=1
    )
    assert rows[0]["iteration_time_s"] == pytest.approx(float(expected.prediction.iteration_time_s[0]))
    for key in ("compute_s", "tp_comm_s", "pp_bubble_s", "pp_p2p_s", "dp_comm_exposed_s", "optimizer_s"):
        assert key in rows[0]


def test_a_small_space_is_searched_exhaustively_by_default_and_botorch_forces_bo(
    capsys, config_path, monkeypatch
):
    monkeypatch.setattr(
        search,
        "bayesian_search",
        functools.partial(search.bayesian_search, max_gp_updates=1, max_local_rounds=0),
    )
    args = ["--gpus", "8", "--system", "a100_80g", "--gbs", "64", "--config", str(config_path), "--top", "2"]
    default = run_json(capsys, *args)
    assert default["method"] == "exhaustive" and default["evaluations"] == default["space_size"]
    out = run_json(capsys, *args, "--botorch")
    assert out["method"] == "bayesian"
    assert out["evaluations"] <= search.BOOTSTRAP_SAMPLES + 1 < out["space_size"]
    assert len(out["candidates"]) == 2


def test_table_shows_the_split_and_why_the_first_wins(capsys, config_path):
    assert (
        main(
            [
                "strategies",
                "--gpus",
                "8",
                "--system",
                "a100_80g",
                "--gbs",
                "64",
                "--config",
                str(config_path),
                "--top",
                "3",
                "--no-botorch",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for heading in ("dp/tp/pp", "compute", "bubble", "DP comm", "GiB per GPU", "tokens/s"):
        assert heading in out
    title = " ".join(out.split())  # rich wraps the title
    assert "memory in GiB per GPU of the 80 GiB each has" in title and "GiB/80" not in out  # not a quotient
    assert "faster than the best other layout" in out and "the largest difference is" in out


@pytest.mark.parametrize(
    ("args", "message", "code"),  # 2: a usage error (a flag's value), 1: what the planner refuses
    [
        (["--gpus", "8", "--system", "no_such_gpu", "--gbs", "64"], "unknown system 'no_such_gpu'", 1),
        (["--gpus", "0", "--system", "a100_80g", "--gbs", "64"], "--gpus", 2),
        (["--gpus", "5", "--system", "a100_80g", "--gbs", "7"], "no valid strategy for 5 GPUs at gbs 7", 1),
        (["--gpus", "8", "--system", "a100_80g", "--gbs", "64", "--top", "0"], "--top", 2),
        (["--gpus", "8", "--system", "a100_80g", "--gbs", "64", "--zero-stages", "one"], "--zero-stages", 2),
    ],
)
def test_bad_inputs_are_one_line_errors(capsys, config_path, args, message, code):
    assert main(["strategies", *args, "--config", str(config_path), "--no-botorch"]) == code
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_missing_model_key_is_named(capsys, tmp_path):
    path = tmp_path / ".conaconfig"
    path.write_text(json.dumps({"model": {"layers": 2, "hidden": 64, "heads": 4, "seq": 32}}))
    assert (
        main(["strategies", "--gpus", "2", "--system", "cpu_gloo", "--gbs", "8", "--config", str(path)]) == 1
    )
    assert "vocab_size" in capsys.readouterr().err
