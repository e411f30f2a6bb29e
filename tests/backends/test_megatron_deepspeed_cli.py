"""``cona train --backend megatron-deepspeed / --repo-path``: what is refused before anything is launched."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cona.backends.megatron_deepspeed.environment import PYTHON_ENV, REPO_ENV, SHIM_ENV
from cona.cli import main
from cona.data.indexed import IndexedDatasetWriter


@pytest.fixture(autouse=True)
def _no_checkout_from_the_environment(monkeypatch):
    for name in (REPO_ENV, PYTHON_ENV, SHIM_ENV):
        monkeypatch.delenv(name, raising=False)


def _fake_checkout(tmp_path: Path) -> tuple[Path, Path]:
    """A checkout with the per-head attention (6acc370a's) and a venv with a deepspeed launcher file."""
    repo = tmp_path / "Megatron-DeepSpeed"
    (repo / "megatron" / "model").mkdir(parents=True)
    (repo / "megatron" / "model" / "transformer.py").write_text("value = self.split_tensor(mixed_x_layer)\n")
    (repo / "pretrain_gpt.py").write_text("")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "deepspeed").write_text("")
    return repo, bin_dir / "python"


def _config(tmp_path: Path, normalization: str = "rmsnorm") -> Path:
    """A random-token dataset (no tokenizer files: the backend names the first one it misses)."""
    prefix = tmp_path / "data" / "tiny"
    prefix.parent.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(50):
            writer.add_document(rng.integers(0, 300, size=40))
    config = {
        "model": {
            "name": "m",
            "layers": 2,
            "hidden": 64,
            "heads": 4,
            "seq": 16,
            "vocab_size": 300,
            "normalization": normalization,
        },
        "training": {"device": "cpu", "data_prefix": str(prefix), "log_root": str(tmp_path / "logs")},
    }
    path = tmp_path / ".conaconfig"
    path.write_text(json.dumps(config))
    return path


def _fixed(tmp_path: Path, config: Path, repo: Path, python: Path) -> list[str]:
    argv = [
        "train",
        "--config",
        str(config),
        "--dp",
        "2",
        "--tp",
        "1",
        "--pp",
        "1",
        "--gbs",
        "4",
        "--mbs",
        "1",
    ]
    return [
        *argv,
        "--iters",
        "2",
        "--workdir",
        str(tmp_path / "w"),
        "--repo-path",
        str(repo),
        "--mds-python",
        str(python),
    ]


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("cona: error: ") and err.count("\n") == 1  # one line, no traceback
    return err


def test_backend_flag_needs_a_checkout(tmp_path, capsys):
    config = _config(tmp_path)
    chain = tmp_path / "chain.json"
    chain.write_text('{"steps": [{"step_num": 1, "dp": 2, "tp": 1, "pp": 1, "gbs": 4, "mbs": 1, '
                     '"train_iters": 2, "is_initial": true}]}')  # fmt: skip
    argv = ["train", "--config", str(config), "--chain", str(chain), "--gpus", "2"]
    assert main([*argv, "--backend", "megatron-deepspeed"]) == 1
    assert "--repo-path (or CONA_MEGATRON_DEEPSPEED) must name a Megatron-DeepSpeed checkout" in _error(
        capsys
    )
    assert main([*argv, "--repo-path", str(tmp_path)]) == 1
    assert "not a Megatron-DeepSpeed checkout (no pretrain_gpt.py)" in _error(capsys)


def test_online_mode_refuses_what_the_backend_cannot_run_before_any_launch(tmp_path, capsys):
    repo, python = _fake_checkout(tmp_path)
    online = ["train", "--gpus", "2", "--system", "cpu_gloo", "--initial-gbs", "4", "--total-iters", "4"]
    online += ["--repo-path", str(repo), "--mds-python", str(python), "--workdir", str(tmp_path / "w")]
    assert main([*online, "--config", str(_config(tmp_path, normalization="layernorm"))]) == 1
    assert "model.normalization=layernorm" in _error(capsys)
    (repo / "megatron" / "model" / "transformer.py").write_text(
        "query_layer = mixed_x_layer[:, :, :self.projection_size]\n"
    )  # the blocked QKV layout of 676a482c and later
    (tmp_path / "b").mkdir()
    text = json.loads(_config(tmp_path / "b").read_text())
    text["training"].update(vocab_file=str(tmp_path / "v.json"), merge_file=str(tmp_path / "m.txt"))
    (tmp_path / "v.json").write_text("{}")
    (tmp_path / "m.txt").write_text("")
    (tmp_path / "b" / ".conaconfig").write_text(json.dumps(text))
    assert main([*online, "--config", str(tmp_path / "b" / ".conaconfig")]) == 1
    assert "online mode may change tp and mbs" in _error(capsys)
    assert not (tmp_path / "w").exists() and not (tmp_path / "logs").exists()
    assert not (tmp_path / "b" / "logs").exists()


def test_repo_path_contradicting_the_native_backend(tmp_path, capsys):
    repo, python = _fake_checkout(tmp_path)
    assert main(["train", "--backend", "native", "--repo-path", str(repo)]) == 2
    assert "drop it or --backend native" in _error(capsys)
    assert main(["train", "--mds-python", str(python)]) == 2
    assert "--mds-python and --mds-shim go with --backend megatron-deepspeed" in _error(capsys)


def test_fixed_mode_refuses_what_the_backend_cannot_run_before_any_launch(tmp_path, capsys):
    repo, python = _fake_checkout(tmp_path)
    assert main(_fixed(tmp_path, _config(tmp_path, normalization="layernorm"), repo, python)) == 1
    assert "model.normalization=layernorm" in _error(capsys)
    (tmp_path / "b").mkdir()
    assert main(_fixed(tmp_path, _config(tmp_path / "b"), repo, python)) == 1  # rmsnorm, but no tokenizer
    assert "training.vocab_file is required by the Megatron-DeepSpeed backend" in _error(capsys)
    assert not (tmp_path / "w").exists() and not (tmp_path / "logs").exists()  # nothing was started
    assert not (tmp_path / "b" / "logs").exists()


def test_fixed_mode_is_a_one_stage_chain_in_a_new_run_directory(tmp_path, capsys, monkeypatch):
    repo, python = _fake_checkout(tmp_path)
    config = _config(tmp_path)
    text = json.loads(config.read_text())
    (tmp_path / "vocab.json").write_text(json.dumps({f"t{i}": i for i in range(300)}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    text["training"].update(vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt"))
    text["model"].pop("vocab_size")
    config.write_text(json.dumps(text))
    calls = []
    monkeypatch.setattr(
        "cona.backends.megatron_deepspeed.run.run_mds_chain", lambda run, env, **_: calls.append((run, env))
    )
    argv = _fixed(tmp_path, config, repo, python) + ["--run-name", "fixed1", "--master-port-base", "29950"]
    assert main(argv) == 0, capsys.readouterr().err
    ((run, env),) = calls
    assert env.repo == repo and run.world_size == 2 and run.base_port == 29950
    assert run.run_dir == tmp_path / "logs" / "fixed1" and run.device_type == "cpu"
    assert run.chain_path is None and list(run.run_dir.iterdir()) == []  # the chain is built in memory
    steps = run.fixed_chain["steps"]
    assert steps == [
        {"step_num": 1, "dp": 2, "tp": 1, "pp": 1, "gbs": 4, "mbs": 1, "train_iters": 2, "is_initial": True}
    ]


def test_several_nodes_started_over_ssh_are_refused(tmp_path, capsys):
    repo, python = _fake_checkout(tmp_path)
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    argv = _fixed(tmp_path, _config(tmp_path), repo, python) + ["--num-nodes", "2", "--gpus-per-node", "1"]
    assert main([*argv, "--hostfile", str(tmp_path / "hostfile"), "--master-addr", "127.0.0.1"]) == 1
    assert "with the Megatron-DeepSpeed backend start every node's runner yourself (--no-ssh" in _error(
        capsys
    )
