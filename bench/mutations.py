"""Plant one known bug at a time in a copy of the project and run the tests that should catch it.

Each mutation replaces one exact piece of source (it must occur exactly once) in a fresh copy of
``src/``, ``tests/`` and ``examples/`` and runs the listed tests against that copy; a mutation whose tests
all pass *survived*: the tests cannot see that bug. The list holds the bugs reviews planted (a
trainer that skips or repeats samples at a gbs change, a worker that ignores its LR factor, ...).

    PYTHONPATH=src .venv/bin/python bench/mutations.py            # every mutation (minutes: real chains)
    PYTHONPATH=src .venv/bin/python bench/mutations.py --only next_window,ignore_lr_factor
    PYTHONPATH=src .venv/bin/python bench/mutations.py --list

Prints one line per mutation (caught / SURVIVED, with the seconds its tests took) and exits 1 when any
survived.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("src", "tests", "examples", "pyproject.toml")
TEST_TIMEOUT_S = 1200


@dataclass(frozen=True, kw_only=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


SAMPLE_TESTS = (
    "tests/runner/test_worker_session.py::test_a_session_chain_trains_as_the_per_stage_launch_does_without_restarting_the_workers",
)
THROUGHPUT_TESTS = ("tests/runner/test_online_throughput.py",)
IN_PLACE_TESTS = (
    "tests/runner/test_online_e2e.py::test_a_gbs_only_switch_happens_in_place_and_trains_as_the_checkpointed_switch",
)
MUTATIONS = (
    Mutation(
        name="next_window",
        why="the trainer fetches the next step's sample window",
        path="src/cona/engine/trainer.py",
        old="progress.consumed_samples, strategy.gbs, strategy.mbs, strategy.dp, ctx.dp_rank",
        new="progress.consumed_samples + strategy.gbs, strategy.gbs, strategy.mbs, strategy.dp, ctx.dp_rank",
        tests=SAMPLE_TESTS,
    ),
    Mutation(
        name="window_from_iteration",
        why="the window is iteration x current gbs (skips or repeats samples at every gbs change)",
        path="src/cona/engine/trainer.py",
        old="progress.consumed_samples, strategy.gbs, strategy.mbs, strategy.dp, ctx.dp_rank",
        new="progress.iteration * strategy.gbs, strategy.gbs, strategy.mbs, strategy.dp, ctx.dp_rank",
        tests=SAMPLE_TESTS,
    ),
    Mutation(
        name="ignore_lr_factor",
        why="the worker ignores the stage's lr_factor (no LR scaling after a gbs change)",
        path="src/cona/engine/stage_build.py",
        old="        config.training,\n        planned_tokens=spec.planned_tokens,\n"
        "        lr_factor=spec.lr_factor,",
        new="        config.training,\n        planned_tokens=spec.planned_tokens,\n        lr_factor=1.0,",
        tests=SAMPLE_TESTS,
    ),
    Mutation(
        name="drop_throughput_correction",
        why="the online search takes the raw model's throughput for a candidate (its correction dropped)",
        path="src/cona/planner/throughput.py",
        old="return strategy.gbs * self.seq / float(step[0])",
        new="return strategy.gbs * self.seq / float(model.raw_step_s[0])",
        tests=THROUGHPUT_TESTS,
    ),
    Mutation(
        name="invert_throughput_correction",
        why="the online search applies the throughput correction inverted",
        path="src/cona/planner/throughput.py",
        old="return strategy.gbs * self.seq / float(step[0])",
        new="return strategy.gbs * self.seq / float(model.raw_step_s[0] ** 2 / step[0])",
        tests=THROUGHPUT_TESTS,
    ),
    Mutation(
        name="marker_before_rename",
        why="publish writes latest_universal before renaming the universal directory into place",
        path="src/cona/runner/publish.py",
        old="        os.replace(tmp, final)\n    write_marker(source.parent / LATEST_UNIVERSAL, final.name)",
        new="        write_marker(source.parent / LATEST_UNIVERSAL, final.name)\n"
        "        os.replace(tmp, final)",
        tests=("tests/runner/test_publish_kills.py",),
    ),
    Mutation(
        name="resave_deletes_old_first",
        why="a re-save of the same iteration deletes the old copy before renaming the new one into place",
        path="src/cona/engine/checkpoint.py",
        old="    if not final_dir.exists():\n        os.replace(tmp_dir, final_dir)\n",
        new="    if True:\n        _remove(final_dir)\n        os.replace(tmp_dir, final_dir)\n",
        tests=("tests/engine/test_checkpoint_kills.py",),
    ),
    Mutation(
        name="prune_newest_periodic",
        why="keep_checkpoints keeps the oldest periodic checkpoints of a stage and removes the newest",
        path="src/cona/engine/periodic_save.py",
        old="sorted(periodic, reverse=True)[keep:]",
        new="sorted(periodic)[keep:]",
        tests=("tests/engine/test_periodic_save.py",),
    ),
    Mutation(
        name="switch_check_10x",
        why="the switch check accepts a probe loss difference of 10x its tolerance",
        path="src/cona/engine/switch_check.py",
        old='status="passed" if finite and difference <= tolerance else "failed",',
        new='status="passed" if finite and difference <= 10 * tolerance else "failed",',
        tests=("tests/engine/test_switch_check.py",),
    ),
    Mutation(
        name="noise_scale_4x_low",
        why="the switching policy reads the noise scale 4x too low",
        path="src/cona/planner/policy.py",
        old="    return noise.noise_scale\n",
        new="    return noise.noise_scale / 4\n",
        tests=("tests/planner/test_plan.py",),
    ),
    Mutation(
        name="in_place_old_window",
        why="an in-place gbs switch takes its window from iteration x new gbs, not the consumed samples",
        path="src/cona/engine/stage_build.py",
        old="progress = dataclasses.replace(carried.progress)",
        new="progress = dataclasses.replace(carried.progress, "
        "consumed_samples=carried.progress.iteration * spec.strategy.gbs)",
        tests=IN_PLACE_TESTS,
    ),
    Mutation(
        name="in_place_ignore_lr_factor",
        why="an in-place switch builds its LR schedule with lr_factor 1 (ignores the new gbs's LR scaling)",
        path="src/cona/engine/stage_build.py",
        old="        spec.config.training,\n        planned_tokens=spec.planned_tokens,\n"
        "        lr_factor=spec.lr_factor,",
        new="        spec.config.training,\n        planned_tokens=spec.planned_tokens,\n"
        "        lr_factor=1.0,",
        tests=IN_PLACE_TESTS,
    ),
    Mutation(
        name="mds_in_place_keeps_old_lr",
        why="a Megatron-DeepSpeed in-place switch leaves the scheduler the old stage's peak and min LR",
        path="src/cona/backends/megatron_deepspeed/launched/cona_in_place.py",
        old="    scheduler.max_lr, scheduler.min_lr = args.lr, args.min_lr\n",
        new="",
        tests=("tests/backends/test_megatron_deepspeed_in_place.py",),
    ),
    Mutation(
        name="mds_in_place_old_micro_batches",
        why="a Megatron-DeepSpeed in-place switch tells DeepSpeed the new gbs, not Megatron's calculator",
        path="src/cona/backends/megatron_deepspeed/launched/cona_in_place.py",
        old="    global_vars._GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculator_class(gbs, mbs, dp)\n",
        new="",
        tests=("tests/backends/test_megatron_deepspeed_in_place.py",),
    ),
)


def copy_project(destination: Path) -> None:
    for name in COPIED:
        source = ROOT / name
        target = destination / name
        if source.is_dir():
            shutil.copytree(
                source, target, ignore=shutil.ignore_patterns("__pycache__", "logs", "checkpoints")
            )
        else:
            shutil.copy2(source, target)
    if (ROOT / "data").exists():
        (destination / "data").symlink_to(ROOT / "data")


def plant(copy: Path, mutation: Mutation) -> None:
    path = copy / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name}: {mutation.path} holds its text {count} times, not once")
    path.write_text(text.replace(mutation.old, mutation.new))


def run_tests(copy: Path, tests: tuple[str, ...]) -> bool:
    """Whether every test passed (the mutation survived)."""
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    return done.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma list of mutation names")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = list(MUTATIONS)
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {m.name for m in MUTATIONS})
        if unknown:
            parser.error(f"--only: unknown mutation(s) {', '.join(unknown)}")
        chosen = [m for m in MUTATIONS if m.name in names]
    if args.list:
        for mutation in chosen:
            print(f"{mutation.name}: {mutation.why} ({mutation.path})")
        return 0
    control_tests = tuple(dict.fromkeys(test for mutation in chosen for test in mutation.tests))
    with tempfile.TemporaryDirectory(prefix="cona-mutation-control-") as tmp:
        copy_project(Path(tmp))
        if not run_tests(Path(tmp), control_tests):  # else a failure would read as a caught bug
            print("the tests fail on the unmutated copy: fix them first", file=sys.stderr)
            return 2
    survivors = []
    for mutation in chosen:
        with tempfile.TemporaryDirectory(prefix=f"cona-mutation-{mutation.name}-") as tmp:
            copy = Path(tmp)
            copy_project(copy)
            plant(copy, mutation)
            began = time.perf_counter()
            survived = run_tests(copy, mutation.tests)
        verdict = "SURVIVED" if survived else "caught"
        print(
            f"{mutation.name:28s} {verdict:8s} {time.perf_counter() - began:6.1f} s  {mutation.why}",
            flush=True,
        )
        if survived:
            survivors.append(mutation.name)
    print(f"{len(chosen) - len(survivors)} caught, {len(survivors)} survived", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
