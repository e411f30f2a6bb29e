"""Plant one known bug at a time in a copy of the project and run the tests that should catch it.

A mutation names a function (``module path`` and qualified name, e.g. ``PeriodicSaves.begin``) and a piece
of code inside it by meaning: ``old`` is parsed, and the function's syntax tree must hold it exactly once,
as an expression or as a run of consecutive statements, whatever its formatting or comments. That piece is
replaced by ``new`` (statements, or nothing) in a fresh copy of ``src/``, ``tests/`` and ``examples/``, and
the listed tests run against the copy; a mutation whose tests all pass *survived*: the tests cannot see that
bug. A mutation whose function or code cannot be found (a refactor moved it) stops the script with the
mutation's name, before any test runs, so none is silently disabled. The list holds the bugs reviews
planted (a trainer that skips or repeats samples at a gbs change, a worker that ignores its LR factor, ...).

    PYTHONPATH=src .venv/bin/python bench/mutations.py            # every mutation (minutes: real chains)
    PYTHONPATH=src .venv/bin/python bench/mutations.py --only next_window,ignore_lr_factor
    PYTHONPATH=src .venv/bin/python bench/mutations.py --list
    PYTHONPATH=src .venv/bin/python bench/mutations.py --check    # only find and plant each, no tests

Prints one line per mutation (caught / SURVIVED, with the seconds its tests took) and exits 1 when any
survived (2 when the tests fail unmutated, or a mutation finds no target).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("src", "tests", "examples", "pyproject.toml")
TEST_TIMEOUT_S = 1200
SKIPPED_ALL = 5
"""pytest's exit status when it ran no test (all skipped count as passed: see :func:`run_tests`)."""


@dataclass(frozen=True, kw_only=True)
class Mutation:
    name: str
    path: str
    function: str
    """Qualified name of the function holding ``old`` (``Class.method``, ``outer.inner``)."""
    old: str
    """An expression, or one or more statements, as Python source (found by syntax, not by text)."""
    new: str
    """What replaces it: an expression for an expression, statements (or "") for statements."""
    tests: tuple[str, ...]
    why: str


class MutationNotFound(Exception):
    """A mutation's function or code is not where it says (one line naming what is missing)."""


SAMPLE_TESTS = (
    "tests/runner/test_worker_session.py::test_a_session_chain_trains_as_the_per_stage_launch_does_without_restarting_the_workers",
)
THROUGHPUT_TESTS = ("tests/runner/schedules/test_online_throughput.py",)
IN_PLACE_TESTS = (
    "tests/runner/schedules/test_online_e2e.py::test_a_gbs_only_switch_happens_in_place_and_trains_as_the_checkpointed_switch",
)
MDS_LOG_TESTS = ("tests/backends/test_megatron_deepspeed_log_parse.py",)
MUTATIONS = (
    Mutation(
        name="next_window",
        why="the trainer fetches the next step's sample window",
        path="src/cona/engine/trainer.py",
        function="_step",
        old="progress.consumed_samples",
        new="progress.consumed_samples + strategy.gbs",
        tests=SAMPLE_TESTS,
    ),
    Mutation(
        name="window_from_iteration",
        why="the window is iteration x current gbs (skips or repeats samples at every gbs change)",
        path="src/cona/engine/trainer.py",
        function="_step",
        old="progress.consumed_samples",
        new="progress.iteration * strategy.gbs",
        tests=SAMPLE_TESTS,
    ),
    Mutation(
        name="ignore_lr_factor",
        why="the worker ignores the stage's lr_factor (no LR scaling after a gbs change)",
        path="src/cona/engine/stage_build.py",
        function="build_stage",
        old="spec.lr_factor",
        new="1.0",
        tests=SAMPLE_TESTS,
    ),
    Mutation(
        name="drop_throughput_correction",
        why="the online search takes the raw model's throughput for a candidate (its correction dropped)",
        path="src/cona/planner/throughput.py",
        function="ThroughputEstimator.predicted_tokens_per_s",
        old="strategy.gbs * self.seq / float(step[0])",
        new="strategy.gbs * self.seq / float(model.raw_step_s[0])",
        tests=THROUGHPUT_TESTS,
    ),
    Mutation(
        name="invert_throughput_correction",
        why="the online search applies the throughput correction inverted",
        path="src/cona/planner/throughput.py",
        function="ThroughputEstimator.predicted_tokens_per_s",
        old="strategy.gbs * self.seq / float(step[0])",
        new="strategy.gbs * self.seq / float(model.raw_step_s[0] ** 2 / step[0])",
        tests=THROUGHPUT_TESTS,
    ),
    Mutation(
        name="marker_before_rename",
        why="publish writes latest_universal before renaming the universal directory into place",
        path="src/cona/runner/publish.py",
        function="publish",
        old="os.replace(tmp, final)",
        new="write_marker(source.parent / LATEST_UNIVERSAL, final.name)\nos.replace(tmp, final)",
        tests=("tests/runner/test_publish_kills.py",),
    ),
    Mutation(
        name="resave_deletes_old_first",
        why="a re-save of the same iteration deletes the old copy before renaming the new one into place",
        path="src/cona/engine/checkpoint/save.py",
        function="_publish",
        old="not final_dir.exists()",
        new="_remove(final_dir) or True",  # removes the old copy, then takes the plain rename
        tests=("tests/engine/test_checkpoint_kills.py",),
    ),
    Mutation(
        name="prune_newest_periodic",
        why="keep_checkpoints keeps the oldest periodic checkpoints of a stage and removes the newest",
        path="src/cona/engine/checkpoint/periodic.py",
        function="prune_periodic",
        old="sorted(periodic, reverse=True)",
        new="sorted(periodic)",
        tests=("tests/engine/test_periodic_save.py",),
    ),
    Mutation(
        name="switch_check_10x",
        why="the switch check accepts a probe loss difference of 10x its tolerance",
        path="src/cona/engine/switch_check.py",
        function="compare_probe",
        old="difference <= tolerance",
        new="difference <= 10 * tolerance",
        tests=("tests/engine/test_switch_check.py",),
    ),
    Mutation(
        name="noise_scale_4x_low",
        why="the switching policy reads the noise scale 4x too low",
        path="src/cona/planner/policy.py",
        function="_usable_noise_scale",
        old="noise.noise_scale * settings.noise_scale_factor",
        new="noise.noise_scale * settings.noise_scale_factor / 4",
        tests=("tests/planner/test_policy.py",),
    ),
    Mutation(
        name="in_place_old_window",
        why="an in-place gbs switch takes its window from iteration x new gbs, not the consumed samples",
        path="src/cona/engine/stage_build.py",
        function="continue_in_place",
        old="dataclasses.replace(carried.progress)",
        new="dataclasses.replace(carried.progress, "
        "consumed_samples=carried.progress.iteration * spec.strategy.gbs)",
        tests=IN_PLACE_TESTS,
    ),
    Mutation(
        name="in_place_ignore_lr_factor",
        why="an in-place switch builds its LR schedule with lr_factor 1 (ignores the new gbs's LR scaling)",
        path="src/cona/engine/stage_build.py",
        function="continue_in_place",
        old="spec.lr_factor",
        new="1.0",
        tests=IN_PLACE_TESTS,
    ),
    Mutation(
        name="mds_in_place_keeps_old_lr",
        why="a Megatron-DeepSpeed in-place switch leaves the scheduler the old stage's peak and min LR",
        path="src/cona/backends/megatron_deepspeed/launched/cona_in_place.py",
        function="switch_batch",
        old="scheduler.max_lr, scheduler.min_lr = args.lr, args.min_lr",
        new="",
        tests=("tests/backends/test_megatron_deepspeed_in_place.py",),
    ),
    Mutation(
        name="mds_in_place_old_micro_batches",
        why="a Megatron-DeepSpeed in-place switch tells DeepSpeed the new gbs, not Megatron's calculator",
        path="src/cona/backends/megatron_deepspeed/launched/cona_in_place.py",
        function="switch_batch",
        old="global_vars._GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculator_class(gbs, mbs, dp)",
        new="",
        tests=("tests/backends/test_megatron_deepspeed_in_place.py",),
    ),
    Mutation(
        name="replay_last_in_place_stage_only",
        why="a kill replay after several in-place switches rebuilds only the last in-place stage",
        path="src/cona/runner/in_place.py",
        function="replay_in_place",
        old="while continues_in_place(first):\n    first -= 1",
        new="",
        tests=("tests/runner/test_in_place_replay.py",),
    ),
    Mutation(
        name="every_rank_hashes_share_0",
        why="on load every rank hashes share 0 of the checkpoint's files instead of its own",
        path="src/cona/engine/checkpoint/load.py",
        function="verify_checkpoint",
        old="shares(sizes, parts)[me]",
        new="shares(sizes, parts)[0]",
        tests=("tests/engine/test_checkpoint_trust.py::test_each_rank_hashes_its_own_share_of_the_files",),
    ),
    Mutation(
        name="save_clock_never_restarts",
        why="the clock of time-based periodic saves is not restarted by a save (every step due after one)",
        path="src/cona/engine/checkpoint/periodic.py",
        function="PeriodicSaves.begin",
        old="self.started_at = time.monotonic()",
        new="",
        tests=("tests/engine/test_periodic_save.py",),
    ),
    Mutation(
        name="lock_closed_without_unlock",
        why="a run_locks scope closes its lock files without unlocking (a launcher it started keeps them)",
        path="src/cona/runner/run_lock.py",
        function="run_locks",
        old="fcntl.flock(fd, fcntl.LOCK_UN)",
        new="",
        tests=(
            "tests/runner/test_run_lock.py::test_a_scope_s_end_releases_its_locks_while_a_launcher_it_started_still_runs",
        ),
    ),
    Mutation(
        name="noise_window_max",
        why="the noise tracker's default window is the larger of 500 base batches and 3/4 of the run",
        path="src/cona/planner/efficiency.py",
        function="NoiseScaleTracker._trimmed",
        old="min(WINDOW_BASE_BATCHES * self.base_batch, WINDOW_FRACTION * newest)",
        new="max(WINDOW_BASE_BATCHES * self.base_batch, WINDOW_FRACTION * newest)",
        tests=("tests/planner/test_efficiency.py",),
    ),
    Mutation(
        name="mds_gbs_from_strategy",
        why="Megatron-DeepSpeed log parsing takes the gbs from the strategy, not from Megatron's line",
        path="src/cona/backends/megatron_deepspeed/log_parse.py",
        function="MetricsRecorder._record",
        old='int(values.get("gbs", strategy.gbs))',
        new="strategy.gbs",
        tests=MDS_LOG_TESTS,
    ),
    Mutation(
        name="mds_evaluation_to_any_pending",
        why="Megatron-DeepSpeed log parsing attaches an evaluation to whatever training record is pending",
        path="src/cona/backends/megatron_deepspeed/log_parse.py",
        function="MetricsRecorder.feed",
        old="pending is not None and during_training and evaluation.iteration == pending.iteration",
        new="pending is not None and during_training",
        tests=MDS_LOG_TESTS,
    ),
)


def _key(node: ast.AST) -> str:
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The function ``qualname`` names (through classes and enclosing functions); raises
    :class:`MutationNotFound`."""
    scope: ast.AST = tree
    for part in qualname.split("."):
        found = [
            node
            for node in ast.iter_child_nodes(scope)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == part
        ]
        if len(found) != 1:
            raise MutationNotFound(f"no single definition of {part!r} (of {qualname}): {len(found)} found")
        scope = found[0]
    if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        raise MutationNotFound(f"{qualname} is not a function")
    return scope


def _statement_lists(function: ast.AST) -> list[list[ast.stmt]]:
    lists = []
    for node in ast.walk(function):
        for name in ("body", "orelse", "finalbody"):
            value = getattr(node, name, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                lists.append(value)
    return lists


class _ExpressionSwap(ast.NodeTransformer):
    """Replaces every expression that is ``old`` (by syntax) with ``new``, counting them."""

    def __init__(self, old: ast.expr, new: ast.expr) -> None:
        self.wanted, self.new, self.count = _key(old), new, 0

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and _key(node) == self.wanted:
            self.count += 1
            return self.new
        return self.generic_visit(node)


def _swap_statements(function: ast.AST, old: list[ast.stmt], new: list[ast.stmt]) -> int:
    """Replace the runs of consecutive statements that are ``old`` (by syntax) with ``new``; returns how many
    there were (only the first is replaced)."""
    wanted = [_key(statement) for statement in old]
    found = [
        (statements, start)
        for statements in _statement_lists(function)
        for start in range(len(statements) - len(old) + 1)
        if [_key(s) for s in statements[start : start + len(old)]] == wanted
    ]
    if found:
        statements, start = found[0]
        statements[start : start + len(old)] = new or [ast.Pass()]
    return len(found)


def mutate_source(source: str, function: str, old: str, new: str) -> str:
    """``source`` with the one occurrence of ``old`` inside ``function`` replaced by ``new`` (re-written
    from its syntax tree); raises :class:`MutationNotFound` unless ``old`` occurs there exactly once."""
    tree = ast.parse(source)
    target = find_function(tree, function)
    old_body, new_body = ast.parse(textwrap.dedent(old)).body, ast.parse(textwrap.dedent(new)).body
    if not old_body:
        raise MutationNotFound("an empty piece of code to replace")
    if len(old_body) == len(new_body) == 1 and all(isinstance(s, ast.Expr) for s in (*old_body, *new_body)):
        swap = _ExpressionSwap(old_body[0].value, new_body[0].value)
        swap.visit(target)
        count = swap.count
    else:
        count = _swap_statements(target, old_body, new_body)
    if count != 1:
        raise MutationNotFound(f"{function} holds {old!r} {count} times, not once")
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


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


def planted(root: Path, mutation: Mutation) -> str:
    """The mutated text of the mutation's file under ``root``; exits naming the mutation when its target is
    not found."""
    path = root / mutation.path
    try:
        return mutate_source(path.read_text(), mutation.function, mutation.old, mutation.new)
    except (OSError, SyntaxError, MutationNotFound) as err:
        raise SystemExit(f"mutation {mutation.name}: {mutation.path}: {err}") from None


def run_tests(copy: Path, tests: tuple[str, ...]) -> str:
    """``passed`` (every test passed: a mutation survived), ``failed``, or ``skipped`` (none ran)."""
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode == SKIPPED_ALL or (done.returncode == 0 and " passed" not in summary):
        return "skipped"
    return "passed" if done.returncode == 0 else "failed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma list of mutation names")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check", action="store_true", help="find and plant every mutation, run no test")
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
            print(f"{mutation.name}: {mutation.why} ({mutation.path}: {mutation.function})")
        return 0
    for mutation in chosen:  # every target found before any test runs
        compile(planted(ROOT, mutation), mutation.path, "exec")
    if args.check:
        print(f"{len(chosen)} mutations found and planted", flush=True)
        return 0
    control_tests = tuple(dict.fromkeys(test for mutation in chosen for test in mutation.tests))
    with tempfile.TemporaryDirectory(prefix="cona-mutation-control-") as tmp:
        copy_project(Path(tmp))
        if run_tests(Path(tmp), control_tests) == "failed":  # else a failure would read as a caught bug
            print("the tests fail on the unmutated copy: fix them first", file=sys.stderr)
            return 2
    survivors, unrun = [], []
    for mutation in chosen:
        with tempfile.TemporaryDirectory(prefix=f"cona-mutation-{mutation.name}-") as tmp:
            copy = Path(tmp)
            copy_project(copy)
            (copy / mutation.path).write_text(planted(copy, mutation))
            began = time.perf_counter()
            outcome = run_tests(copy, mutation.tests)
        verdict = {"passed": "SURVIVED", "failed": "caught", "skipped": "NOT RUN"}[outcome]
        print(
            f"{mutation.name:32s} {verdict:8s} {time.perf_counter() - began:6.1f} s  {mutation.why}",
            flush=True,
        )
        if outcome == "passed":
            survivors.append(mutation.name)
        elif outcome == "skipped":
            unrun.append(mutation.name)
    caught = len(chosen) - len(survivors) - len(unrun)
    print(
        f"{caught} caught, {len(survivors)} survived, {len(unrun)} not run (their tests skipped)", flush=True
    )
    return 1 if survivors or unrun else 0


if __name__ == "__main__":
    sys.exit(main())
