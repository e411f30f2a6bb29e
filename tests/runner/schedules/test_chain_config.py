"""Chain config validation: every rule refuses a bad file before anything runs, naming file, step and key."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from tests.helpers.chain_fakes import seed_shaped_chain, tiny_layout, write_fake_chain_config
from tests.helpers.paths import ROOT

from cona.config.file import load_config
from cona.errors import ChainError
from cona.runner.chain_file import load_chain, planned_iterations, planned_tokens


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    write_fake_chain_config(tmp_path)
    return tmp_path


def load(workdir: Path, chain: dict, *, world_size: int = 4):
    path = workdir / "chain.json"
    path.write_text(json.dumps(chain))
    config = load_config(workdir / ".conaconfig")
    return load_chain(path, config=config, world_size=world_size, dtype="fp32", workdir=workdir)


def error_of(workdir: Path, chain: dict, **kwargs) -> str:
    with pytest.raises(ChainError) as info:
        load(workdir, chain, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert str(workdir / "chain.json") in message
    return message


def mutated(edit) -> dict:
    chain = copy.deepcopy(seed_shaped_chain())
    edit(chain)
    return chain


def test_the_seed_shape_is_valid(workdir):
    chain = load(workdir, seed_shaped_chain(iters=200))
    assert [step.layout for step in chain.steps] == ["tp1_pp2_dp2_sp1", "tp1_pp1_dp4_sp1", "tp1_pp1_dp4_sp1"]
    assert planned_iterations(chain) == [(0, 200), (200, 400), (400, 600)]
    assert planned_tokens(chain, seq=8) == 200 * (8 + 16 + 32) * 8
    assert [rule.mode for rule in chain.rules_after(3)] == ["delete-all"]
    assert chain.steps[1].target_iteration(250) == 450  # extra_iters counts from the loaded checkpoint
    assert chain.steps[2].target_iteration(250) == 600  # target_iters is absolute


def test_digest_ignores_formatting_but_not_content(workdir):
    first = load(workdir, seed_shaped_chain()).digest
    (workdir / "chain.json").write_text(json.dumps(seed_shaped_chain(), indent=4))
    config = load_config(workdir / ".conaconfig")
    again = load_chain(workdir / "chain.json", config=config, world_size=4, dtype="fp32", workdir=workdir)
    assert again.digest == first
    assert load(workdir, seed_shaped_chain(iters=4)).digest != first


BAD_CHAINS = {
    "unknown top-level key": (
        lambda c: c.update(prunning=c.pop("pruning")),
        ["'prunning'", "did you mean 'pruning'"],
    ),
    "unknown step key": (
        lambda c: c["steps"][1].update(extra_iter=1),
        ["steps[1] (step_num 2)", "did you mean 'extra_iters'"],
    ),
    "number as a string": (lambda c: c["steps"][0].update(gbs="8"), ["step_num 1", "gbs", "drop the quotes"]),
    "float degree": (lambda c: c["steps"][1].update(dp=2.5), ["step_num 2", "dp: expected an integer"]),
    "non-positive mbs": (lambda c: c["steps"][0].update(mbs=0), ["step_num 1", "mbs: must be positive"]),
    "bool as string": (
        lambda c: c["steps"][0].update(convert="yes"),
        ["step_num 1", "convert: expected true or false"],
    ),
    "missing mbs": (lambda c: c["steps"][2].pop("mbs"), ["step_num 3", "missing required key 'mbs'"]),
    "no stop key": (
        lambda c: c["steps"][1].pop("extra_iters"),
        ["step_num 2", "exactly one of train_iters", "got none"],
    ),
    "two stop keys": (
        lambda c: c["steps"][1].update(train_iters=9),
        ["step_num 2", "got train_iters, extra_iters"],
    ),
    "numbering gap": (
        lambda c: c["steps"][2].update(step_num=4),
        ["steps[2]", "step_num: expected 3", "got 4"],
    ),
    "first not initial": (lambda c: c["steps"][0].pop("is_initial"), ["step 1", "is_initial", "first step"]),
    "second initial": (
        lambda c: c["steps"][1].update(is_initial=True),
        ["step 2", "is_initial", "steps 1, 2"],
    ),
    "world size": (lambda c: c["steps"][1].update(dp=2), ["step 2", "dp*tp*pp = 2*1*1 = 2", "4 processes"]),
    "load layout differs": (
        lambda c: c["steps"][1].update(load_pp=1),
        ["step 2", "load_pp: 1", "step 1", "pp=2"],
    ),
    "load on the initial step": (lambda c: c["steps"][0].update(load_dp=2), ["step 1", "load_dp", "initial"]),
    "too few micro-batches for the pipeline": (
        lambda c: c["steps"][0].update(mbs=4),
        ["step 1", "at least pp=2 micro-batches"],
    ),
    "gbs not divisible": (
        lambda c: c["steps"][1].update(gbs=20),
        ["step 2", "gbs=20 is not a multiple of mbs*dp=16"],
    ),
    "absolute stop behind": (
        lambda c: c["steps"][2].update(target_iters=5),
        ["step 3", "target_iters: 5", "(6)"],
    ),
    "prune stage missing": (
        lambda c: c["pruning"][0].update(stage=7),
        ["pruning[0] (stage 7)", "stage: there is no step 7"],
    ),
    "prune dir of another layout": (
        lambda c: c["pruning"][0].update(ckpt_dir=tiny_layout(1, 1, 4)),
        ["pruning[0] (stage 1)", "ckpt_dir", "tp1_pp2_dp2_sp1"],
    ),
    "prune dir of another dtype": (
        lambda c: c["pruning"][0].update(ckpt_dir="checkpoints/tiny/z1/bf16/tp1_pp2_dp2_sp1"),
        ["pruning[0]", "ckpt_dir"],
    ),
    "prune mode": (lambda c: c["pruning"][1].update(mode="keep-all"), ["pruning[1]", 'mode: "keep-all"']),
    "prune key": (lambda c: c["pruning"][1].update(dir="x"), ["pruning[1]", "unknown key 'dir'"]),
    "delete-all removes what the next stage loads": (
        lambda c: c["pruning"].append({"stage": 2, "ckpt_dir": tiny_layout(1, 1, 4), "mode": "delete-all"}),
        ["pruning[2] (stage 2)", "mode: delete-all would remove the universal checkpoint step 3 loads"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CHAINS))
def test_bad_chain_is_refused_naming_step_and_key(workdir, case):
    edit, expected = BAD_CHAINS[case]
    message = error_of(workdir, mutated(edit))
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_layout_is_checked_against_the_model(workdir):
    config = json.loads((workdir / ".conaconfig").read_text())
    config["model"]["heads"] = 2
    (workdir / ".conaconfig").write_text(json.dumps(config))
    chain = {
        "steps": [
            {
                "step_num": 1,
                "dp": 1,
                "tp": 4,
                "pp": 1,
                "gbs": 8,
                "mbs": 8,
                "train_iters": 2,
                "is_initial": True,
            }
        ]
    }
    message = error_of(workdir, chain)
    assert "step 1" in message and "tp=4 does not divide model.heads=2" in message


def test_empty_and_malformed_files(workdir):
    assert "'steps' must be a non-empty list" in error_of(workdir, {"steps": []})
    assert "top level must be an object" in error_of(workdir, [])
    (workdir / "broken.json").write_text('{"steps": [')
    config = load_config(workdir / ".conaconfig")
    with pytest.raises(ChainError, match="broken.json: not valid JSON"):
        load_chain(workdir / "broken.json", config=config, world_size=4, dtype="fp32", workdir=workdir)
    with pytest.raises(ChainError, match="missing.json does not exist"):
        load_chain(workdir / "missing.json", config=config, world_size=4, dtype="fp32", workdir=workdir)


def test_prune_dir_may_be_absolute_or_spelled_differently(workdir):
    def respell(chain):
        chain["pruning"][0]["ckpt_dir"] = str(workdir / tiny_layout(1, 2, 2))
        chain["pruning"][1]["ckpt_dir"] = "./" + tiny_layout(1, 1, 4) + "/"

    chain = load(workdir, mutated(respell))
    assert len(chain.pruning) == 2


def test_delete_all_is_allowed_where_nothing_later_loads_the_copies(workdir):
    def no_convert_then_delete(chain):
        chain["steps"][0]["convert"] = False  # step 2 loads step 1's plain global_step directory
        chain["pruning"][0]["mode"] = "delete-all"

    assert load(workdir, mutated(no_convert_then_delete)).pruning[0].mode == "delete-all"


EXAMPLES = [
    ("gpt/chain_config_test_200iters.json", "gpt/.conaconfig", 4, "bf16", 600),
    ("gpt/chain_config.json", "gpt/.conaconfig", 4, "bf16", 10000),
    ("gpt/chain_config_multinode_12gpu.json", "gpt/.conaconfig", 12, "bf16", 800),
    ("llama/chain_config_test_200iters.json", "llama/.conaconfig", 4, "bf16", 600),
    ("llama/chain_config.json", "llama/.conaconfig", 4, "bf16", 10000),
    ("llama/chain_config_multinode_12gpu.json", "llama/.conaconfig", 12, "bf16", 800),
    ("tiny/chain_cpu.json", "tiny/.conaconfig", 4, "fp32", 40),
    ("tiny/chain_layout_only.json", "tiny/.conaconfig", 4, "fp32", 24),
]


@pytest.mark.parametrize(("chain_file", "config_file", "world_size", "dtype", "iterations"), EXAMPLES)
def test_examples_are_valid(tmp_path, chain_file, config_file, world_size, dtype, iterations):
    config = load_config(ROOT / "examples" / config_file)
    chain = load_chain(
        ROOT / "examples" / chain_file, config=config, world_size=world_size, dtype=dtype, workdir=tmp_path
    )
    assert planned_iterations(chain)[-1][1] == iterations
    assert chain.steps[0].is_initial and all(step.load_dp is not None for step in chain.steps[1:])


def test_seed_example_covers_what_the_readme_promises():
    config = load_config(ROOT / "examples" / "gpt" / ".conaconfig")
    chain = load_chain(
        ROOT / "examples" / "gpt" / "chain_config_test_200iters.json",
        config=config,
        world_size=4,
        dtype="bf16",
        workdir=ROOT,
    )
    shapes = [(s.dp, s.tp, s.pp, s.gbs) for s in chain.steps]
    assert shapes == [(2, 1, 2, 8), (4, 1, 1, 16), (4, 1, 1, 32)]
    assert [s.convert for s in chain.steps] == [True, True, False]
    assert {rule.mode for rule in chain.pruning} == {"keep-latest", "delete-all"}
    tiny = load_chain(
        ROOT / "examples" / "tiny" / "chain_cpu.json",
        config=load_config(ROOT / "examples" / "tiny" / ".conaconfig"),
        world_size=4,
        dtype="fp32",
        workdir=ROOT,
    )
    assert [(s.dp, s.tp, s.pp, s.gbs) for s in tiny.steps] == [
        (2, 1, 2, 8),
        (4, 1, 1, 16),
        (2, 2, 1, 32),
        (1, 1, 4, 32),
    ]
    layout_only = load_chain(
        ROOT / "examples" / "tiny" / "chain_layout_only.json",
        config=load_config(ROOT / "examples" / "tiny" / ".conaconfig"),
        world_size=4,
        dtype="fp32",
        workdir=ROOT,
    )
    assert len({s.gbs for s in layout_only.steps}) == 1 and len({s.layout for s in layout_only.steps}) == 4
