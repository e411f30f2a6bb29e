"""Stage commands and ds_config of the Megatron-DeepSpeed backend, against the flag reference
(../shared/reference/megatron-deepspeed-formats.md sections 1 and 5)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from cona.backends.megatron_deepspeed.commands import (
    CPU_FUSION_OFF,
    CheckpointLoad,
    LaunchPlacement,
    StageArgs,
    chain_shape,
    check_supported,
    ds_config,
    launcher_command,
    pretrain_args,
    vocab_divisor,
)
from cona.config import parse_config
from cona.engine.optim import lr_schedule
from cona.errors import ConfigError, LayoutError
from cona.strategy import Strategy

GPT2_VOCAB = 50257


def _config(**training):
    raw = {
        "model": {
            "name": "gpt-t",
            "layers": 2,
            "hidden": 64,
            "heads": 4,
            "seq": 64,
            "normalization": "rmsnorm",
        },
        "training": {
            "zero_stage": 1,
            "dtype": "bf16",
            "base_gbs": 4,
            "base_lr": 1e-3,
            "base_min_lr": 1e-4,
            "data_prefix": "/d/tiny_text_document",
            "vocab_file": "/d/vocab.json",
            "merge_file": "/d/merges.txt",
            "split": "90,8,2",
            **training,
        },
    }
    return parse_config(raw, source=None)


def _flag(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times"
    return args[args.index(flag) + 1]


def _stage_args(tmp_path: Path, config, **changes) -> StageArgs:
    values = {
        "ds_config_path": tmp_path / "ds.json",
        "stop_tokens": 1024,
        "save_dir": tmp_path / "ck" / "tp1_pp2_dp1_sp1",
        "load": None,
        "schedule": lr_schedule(config.training, planned_tokens=4096),
        "override_scheduler": False,
        "device_type": "cpu",
        "run_name": "r1",
    }
    return StageArgs(**{**values, **changes})


@pytest.mark.parametrize(
    ("dp", "mbs", "gbs", "accumulation"), [(1, 1, 4, 4), (2, 1, 8, 4), (2, 2, 8, 2), (4, 2, 8, 1)]
)
def test_ds_config_batch_identity(dp, mbs, gbs, accumulation):
    strategy = Strategy(dp=dp, tp=1, pp=1, mbs=mbs, gbs=gbs)
    config = ds_config(strategy, _config().training, "cpu")
    assert config["train_batch_size"] == gbs == mbs * accumulation * dp
    assert config["train_micro_batch_size_per_gpu"] == mbs
    assert config["gradient_accumulation_steps"] == accumulation
    assert config["zero_optimization"] == {"stage": 1}
    assert config["gradient_clipping"] == 1.0
    assert "bf16" not in config and "fp16" not in config  # CPU trains in fp32


def test_ds_config_precision_on_cuda():
    strategy = Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=4)
    bf16 = ds_config(strategy, _config(dtype="bf16").training, "cuda")
    assert bf16["bf16"] == {"enabled": True} and bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    fp16 = ds_config(strategy, _config(dtype="fp16").training, "cuda")
    assert fp16["fp16"]["enabled"] is True and fp16["fp16"]["loss_scale"] == 0


def test_ds_config_refuses_a_gbs_that_is_not_a_multiple_of_mbs_times_dp():
    with pytest.raises(LayoutError, match="gbs=6 is not a multiple of mbs\\*dp=4"):
        ds_config(Strategy(dp=2, tp=1, pp=1, mbs=2, gbs=6), _config().training, "cpu")


@pytest.mark.parametrize(("divisor", "tps"), [(128, (1, 2)), (64, (1, 2, 4)), (128, (2, 8, 1)), (1, (3, 1))])
def test_vocab_pads_to_one_size_under_every_tp_of_the_chain(divisor, tps):
    config = _config()
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, make_vocab_size_divisible_by=divisor)
    )
    shape = chain_shape(
        config, [(Strategy(dp=1, tp=tp, pp=1, mbs=1, gbs=4), 4 * (i + 1)) for i, tp in enumerate(tps)]
    )
    # Megatron pads the vocabulary up to a multiple of make_vocab_size_divisible_by * tp.
    padded = {
        tp: math.ceil(GPT2_VOCAB / (vocab_divisor(shape, tp) * tp)) * vocab_divisor(shape, tp) * tp
        for tp in tps
    }
    assert len(set(padded.values())) == 1
    assert all(size % divisor == 0 for size in padded.values())  # still honours the configured divisor


def test_vocab_divisor_matches_the_native_padding_when_tp_divides_it():
    shape = chain_shape(_config(), [(Strategy(dp=1, tp=tp, pp=1, mbs=1, gbs=4), 4) for tp in (1, 2)])
    assert (vocab_divisor(shape, 1), vocab_divisor(shape, 2)) == (128, 64)  # both pad 50257 to 50304


def test_chain_shape_train_samples_and_stop_tokens():
    stages = [
        (Strategy(dp=1, tp=1, pp=2, mbs=1, gbs=4), 10),
        (Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=16), 20),
        (Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=8), 25),
    ]
    shape = chain_shape(_config(), stages)
    assert shape.stop_tokens == (40 * 64, 200 * 64, 240 * 64)
    # train_iters = train_samples // gbs must reach every stage's stop iteration.
    assert all(shape.train_samples // strategy.gbs >= stop for strategy, stop in stages)


def test_pretrain_args_of_a_first_stage(tmp_path):
    config = _config()
    strategy = Strategy(dp=1, tp=1, pp=2, mbs=1, gbs=4)
    shape = chain_shape(config, [(strategy, 4), (Strategy(dp=1, tp=2, pp=1, mbs=1, gbs=4), 8)])
    args = pretrain_args(config, strategy, shape, _stage_args(tmp_path, config))
    expected = {
        "--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
        "--max-position-embeddings": "64", "--normalization": "rmsnorm",
        "--make-vocab-size-divisible-by": "128",
        "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "2", "--micro-batch-size": "1",
        "--global-batch-size": "4", "--data-path": "/d/tiny_text_document", "--data-impl": "mmap",
        "--split": "90,8,2", "--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": "/d/vocab.json",
        "--merge-file": "/d/merges.txt", "--train-samples": str(shape.train_samples),
        "--train-tokens": "1024",
        "--lr-decay-style": "cosine", "--lr-warmup-tokens": "41", "--lr-decay-tokens": "4096",
        "--save": str(tmp_path / "ck" / "tp1_pp2_dp1_sp1"), "--deepspeed_config": str(tmp_path / "ds.json"),
        "--zero-stage": "1", "--eval-iters": "10", "--log-interval": "10",
    }  # fmt: skip
    for flag, value in expected.items():
        assert _flag(args, flag) == value, flag
    assert float(_flag(args, "--lr")) == 1e-3 and float(_flag(args, "--min-lr")) == 1e-4
    assert "--deepspeed" in args and set(CPU_FUSION_OFF) <= set(args)
    for absent in (
        "--load",
        "--universal-checkpoint",
        "--override-opt_param-scheduler",
        "--bf16",
        "--skip-train",
    ):
        assert absent not in args
    flags = [arg for arg in args if arg.startswith("--")]
    assert len(flags) == len(set(flags))


def test_pretrain_args_of_a_stage_that_loads_a_universal_checkpoint(tmp_path):
    config = _config()
    strategy = Strategy(dp=1, tp=2, pp=1, mbs=1, gbs=4)
    shape = chain_shape(config, [(Strategy(dp=1, tp=1, pp=2, mbs=1, gbs=4), 4), (strategy, 8)])
    load = CheckpointLoad.from_path(tmp_path / "ck" / "tp1_pp2_dp1_sp1" / "global_step4_universal")
    args = pretrain_args(
        config, strategy, shape, _stage_args(tmp_path, config, load=load, override_scheduler=True)
    )
    assert _flag(args, "--load") == str(tmp_path / "ck" / "tp1_pp2_dp1_sp1")
    assert _flag(args, "--load-tag") == "global_step4_universal"
    assert "--universal-checkpoint" in args and "--override-opt_param-scheduler" in args
    assert _flag(args, "--make-vocab-size-divisible-by") == "64"


def test_pretrain_args_of_an_evaluation_only_launch(tmp_path):
    config = _config()
    strategy = Strategy(dp=1, tp=2, pp=1, mbs=1, gbs=4)
    shape = chain_shape(config, [(strategy, 4)])
    load = CheckpointLoad.from_path(tmp_path / "global_step4_universal")
    probe = _stage_args(
        tmp_path, config, load=load, stop_tokens=None, save_dir=None, skip_train=True, eval_iters=3
    )
    args = pretrain_args(config, strategy, shape, probe)
    assert "--skip-train" in args and "--save" not in args and "--train-tokens" not in args
    assert _flag(args, "--eval-iters") == "3"


def test_pretrain_args_on_cuda_and_with_tracking(tmp_path):
    config = _config(dtype="bf16", tensorboard_dir=str(tmp_path / "tb"), wandb_project="p", wandb_dir="/w")
    strategy = Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=4)
    args = pretrain_args(
        config,
        strategy,
        chain_shape(config, [(strategy, 4)]),
        _stage_args(tmp_path, config, device_type="cuda"),
    )
    assert "--bf16" in args and not set(CPU_FUSION_OFF) & set(args)
    assert _flag(args, "--tensorboard-dir") == str(tmp_path / "tb" / "r1")
    assert (
        _flag(args, "--wandb-project"),
        _flag(args, "--wandb-exp-name"),
        _flag(args, "--wandb-save-dir"),
    ) == (
        "p",
        "r1",
        "/w",
    )


def test_checkpoint_load_from_a_directory():
    plain = CheckpointLoad.from_path(Path("/c/tp1_pp1_dp2_sp1/global_step8"))
    assert (plain.directory, plain.tag, plain.universal) == (
        Path("/c/tp1_pp1_dp2_sp1"),
        "global_step8",
        False,
    )
    with pytest.raises(ConfigError, match="global_step"):
        CheckpointLoad.from_path(Path("/c/tp1_pp1_dp2_sp1"))


def test_launcher_command_on_one_node_and_on_several():
    script = Path("/repo/pretrain_gpt.py")
    one = launcher_command(
        Path("/v/bin/deepspeed"),
        LaunchPlacement(processes_per_node=2, master_port=29601),
        script,
        ["--x", "1"],
    )
    assert one == [
        "/v/bin/deepspeed",
        "--num_gpus",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "29601",
        str(script),
        "--x",
        "1",
    ]
    placement = LaunchPlacement(
        processes_per_node=4,
        master_port=29602,
        master_addr="10.0.0.1",
        hostfile=Path("/nfs/hosts"),
        node_rank=2,
    )
    many = launcher_command(Path("/v/bin/deepspeed"), placement, script, [])
    assert _flag(many, "--hostfile") == "/nfs/hosts" and _flag(many, "--node_rank") == "2"
    assert "--no_ssh" in many and _flag(many, "--master_addr") == "10.0.0.1"
    assert many.index("--no_ssh") < many.index(str(script))  # launcher options before the script


def test_unsupported_settings_are_refused_with_their_key():
    strategy = Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=4)
    with pytest.raises(ConfigError, match="model.normalization"):
        config = _config()
        config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, normalization="layernorm")
        )
        check_supported(config, strategy, "cpu")
    with pytest.raises(ConfigError, match="training.zero_stage=2"):
        check_supported(_config(), dataclasses.replace(strategy, zero_stage=2), "cpu")
    check_supported(_config(), strategy, "cpu")


@pytest.mark.parametrize(
    ("model_keys", "key"),
    [
        ({"family": "llama"}, "model.family=llama"),
        ({"kv_heads": 2}, "model.kv_heads=2"),
        ({"tie_embeddings": False}, "model.tie_embeddings=False"),
    ],
)
def test_model_structures_pretrain_gpt_cannot_express_are_refused(model_keys, key):
    config = parse_config(
        {**_config().to_dict(), "model": {**_config().to_dict()["model"], **model_keys}}, source=None
    )
    with pytest.raises(ConfigError, match=key):
        check_supported(config, Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=4), "cpu")
