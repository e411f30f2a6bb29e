"""Conversion between stages: the cat_dim repair (defect A) on a synthetic universal checkpoint, the publish
flow around the converter, the fused-QKV refusal (defect B) and the checkout environment."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cona.backends.megatron_deepspeed.environment import (
    ATTENTION_SOURCE,
    MdsEnvironment,
    qkv_layout,
    resolve_environment,
)
from cona.backends.megatron_deepspeed.run import check_checkout
from cona.backends.megatron_deepspeed.universal import publish, repair_row_parallel
from cona.errors import ChainError, CheckpointError, ConfigError
from cona.strategy import Strategy

ROW_PARALLEL = ("3.self_attention.dense.weight", "4.mlp.dense_4h_to_h.weight")
OTHERS = (
    "3.self_attention.query_key_value.weight",
    "3.self_attention.dense.bias",
    "tied_modules.embed.word_embeddings.weight",
)
# One line of each attention (HEAD f4157bea and 6acc370a): what qkv_layout reads.
BLOCKED_SOURCE = (
    "query_layer = mixed_x_layer[:, :, :self.projection_size].reshape(seq_len, bs, -1, self.head_dim)\n"
)
PER_HEAD_SOURCE = "(query_layer, key_layer, value_layer) = self.split_tensor(mixed_x_layer)\n"


# ds_to_universal's output for a tp=1 save: every parameter's states with cat_dim 0. Shared by the tests and
# the fake converter below (which runs it in a subprocess that needs only torch).
WRITE_UNIVERSAL = """
def write_universal(root, names, cat_dim):
    import torch
    for name in names:
        for state in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
            path = root / "zero" / name / state
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"param": torch.arange(8.0).reshape(2, 4), "cat_dim": cat_dim}, path)
        torch.save(torch.tensor(4), root / "zero" / name / "step.pt")
    return root
"""


def _write_universal(root: Path, cat_dim: int = 0) -> Path:
    namespace: dict = {}
    exec(WRITE_UNIVERSAL, namespace)  # noqa: S102 (our own constant, shared with the fake converter)
    return namespace["write_universal"](root, ROW_PARALLEL + OTHERS, cat_dim)


def _cat_dims(root: Path) -> dict[tuple[str, str], int]:
    return {
        (name, state): torch.load(root / "zero" / name / state, weights_only=False)["cat_dim"]
        for name in ROW_PARALLEL + OTHERS
        for state in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt")
    }


def test_repair_rewrites_cat_dim_of_row_parallel_weights_and_their_adam_states(tmp_path):
    universal = _write_universal(tmp_path / "global_step4_universal")
    assert repair_row_parallel(universal) == ROW_PARALLEL
    dims = _cat_dims(universal)
    assert all(dims[(name, state)] == 1 for name, state in dims if name in ROW_PARALLEL)
    assert all(dims[(name, state)] == 0 for name, state in dims if name in OTHERS)
    saved = torch.load(universal / "zero" / ROW_PARALLEL[0] / "exp_avg.pt", weights_only=False)
    assert torch.equal(saved["param"], torch.arange(8.0).reshape(2, 4))  # only the hint changes
    assert repair_row_parallel(universal) == ()  # idempotent


class _Payload:
    """Unpickling it creates ``marker``: a state file crafted to run code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_repair_refuses_a_crafted_state_file_and_runs_nothing(tmp_path):
    universal = _write_universal(tmp_path / "global_step4_universal")
    crafted = universal / "zero" / ROW_PARALLEL[0] / "exp_avg.pt"
    marker = tmp_path / "ran"
    torch.save({"param": torch.zeros(2), "cat_dim": 0, "hook": _Payload(marker)}, crafted)
    with pytest.raises(CheckpointError, match=rf"^{crafted}: refused, .*; nothing in it was run$"):
        repair_row_parallel(universal)
    assert not marker.exists()
    torch.load(crafted, weights_only=False)  # what the repair used to do: it runs the payload
    assert marker.exists()


def test_repair_leaves_a_checkpoint_saved_at_tp2_alone(tmp_path):
    universal = _write_universal(tmp_path / "u", cat_dim=1)
    assert repair_row_parallel(universal) == ()


def _fake_converter(tmp_path: Path, *, fail: bool = False) -> MdsEnvironment:
    """An interpreter that answers ``-m deepspeed.checkpoint.ds_to_universal`` as the real converter does for
    a tp=1 save (or fails), so the publish flow can be tested without DeepSpeed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    script = tmp_path / "bin" / "python"
    script.parent.mkdir()
    script.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(
            f"""
            import sys
            from pathlib import Path
            output = Path(sys.argv[sys.argv.index("--output_folder") + 1])
            if {fail!r}:
                print("Traceback: ModuleNotFoundError: No module named 'megatron'")
                sys.exit(1)
            """
        )
        + WRITE_UNIVERSAL
        + f"write_universal(output, {ROW_PARALLEL + OTHERS!r}, 0)\n"
        + "(output.parent / 'latest_universal').write_text(output.name)\n"
    )
    script.chmod(0o755)
    return MdsEnvironment(repo=repo, python=script)


def test_publish_converts_repairs_and_marks(tmp_path):
    env = _fake_converter(tmp_path)
    source = tmp_path / "ck" / "tp1_pp2_dp1_sp1" / "global_step4"
    source.mkdir(parents=True)
    publication = publish(env, source, base_env=os.environ)
    assert publication.universal == source.parent / "global_step4_universal"
    assert publication.repaired == ROW_PARALLEL
    assert (source.parent / "latest_universal").read_text() == "global_step4_universal"
    assert not (source.parent / "global_step4_universal.tmp").exists()
    assert _cat_dims(publication.universal)[(ROW_PARALLEL[1], "exp_avg_sq.pt")] == 1
    again = publish(env, source, base_env=os.environ)  # a rerun after a kill only rewrites the marker
    assert again.universal == publication.universal and again.repaired == ()
    (source / "mp_rank_00_model_states.pt").write_text("a later save of the same iteration")
    redone = publish(env, source, base_env=os.environ)  # the old copy is another checkpoint's: converted anew
    assert redone.repaired == ROW_PARALLEL


def test_publish_without_repair_keeps_the_converter_output(tmp_path):
    env = _fake_converter(tmp_path)
    source = tmp_path / "ck" / "global_step4"
    source.mkdir(parents=True)
    publication = publish(env, source, base_env=os.environ, repair=False)
    assert publication.repaired == () and _cat_dims(publication.universal)[(ROW_PARALLEL[0], "fp32.pt")] == 0


def test_a_failed_conversion_names_its_log_and_publishes_nothing(tmp_path):
    env = _fake_converter(tmp_path, fail=True)
    source = tmp_path / "ck" / "global_step4"
    source.mkdir(parents=True)
    with pytest.raises(CheckpointError, match="ds_to_universal failed .*No module named 'megatron'"):
        publish(env, source, base_env=os.environ)
    assert not (source.parent / "latest_universal").exists()
    assert not (source.parent / "global_step4_universal").exists()


def _checkout(tmp_path: Path, source: str) -> MdsEnvironment:
    repo = tmp_path / "checkout"
    (repo / ATTENTION_SOURCE).parent.mkdir(parents=True)
    (repo / ATTENTION_SOURCE).write_text(source)
    (repo / "pretrain_gpt.py").write_text("")
    return MdsEnvironment(repo=repo, python=Path(sys.executable))


def _strategies(*tps: int, mbs: int = 1) -> list[Strategy]:
    return [Strategy(dp=2 // tp, tp=tp, pp=1, mbs=mbs, gbs=4) for tp in tps]


def test_blocked_qkv_layout_refuses_a_tp_change(tmp_path):
    env = _checkout(tmp_path, BLOCKED_SOURCE)
    assert qkv_layout(env.repo) == "blocked"
    with pytest.raises(
        ChainError, match="chain.json: the chain changes the tensor-parallel degree \\(tp1 -> tp2"
    ):
        check_checkout(env, _strategies(1, 2), where="chain.json")
    with pytest.raises(ChainError, match="mbs=2"):
        check_checkout(env, _strategies(1, 1, mbs=2), where="chain.json")
    check_checkout(env, _strategies(2, 2), where="chain.json")  # dp/pp changes reshard correctly


def test_per_head_qkv_layout_allows_a_tp_change(tmp_path):
    env = _checkout(tmp_path, PER_HEAD_SOURCE)
    assert qkv_layout(env.repo) == "per-head"
    check_checkout(env, _strategies(1, 2, 1, mbs=2), where="chain.json")


def test_environment_from_flags_or_variables(tmp_path):
    env = _checkout(tmp_path, PER_HEAD_SOURCE)
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "deepspeed").write_text("")
    variables = {"CONA_MEGATRON_DEEPSPEED_PYTHON": str(bin_dir / "python")}
    resolved = resolve_environment(env.repo, None, None, variables)
    assert resolved.repo == env.repo and resolved.python == bin_dir / "python"
    assert resolved.deepspeed_launcher == bin_dir / "deepspeed"
    process_env = resolved.process_env({"PYTHONPATH": "/x"}, device_type="cpu")
    assert process_env["PYTHONPATH"] == os.pathsep.join([str(env.repo), "/x"])
    assert process_env["DS_ACCELERATOR"] == "cpu"
    with pytest.raises(ConfigError, match="--repo-path .*no pretrain_gpt.py"):
        resolve_environment(tmp_path, None, None, variables)
    with pytest.raises(ConfigError, match="--repo-path \\(or CONA_MEGATRON_DEEPSPEED\\)"):
        resolve_environment(None, None, None, {})
    with pytest.raises(ConfigError, match="--mds-shim"):
        resolve_environment(env.repo, None, tmp_path / "missing", variables)
