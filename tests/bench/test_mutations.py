"""bench/mutations.py finds each planted bug by syntax inside its function, and stops on one it cannot find
(a refactor that moved the code must not leave the mutation silently testing nothing)."""

from __future__ import annotations

import re

import pytest

SOURCE = """
class Saves:
    def begin(self):
        self.pending = self.start(
            progress,  # a comment and a line break change nothing
        )
        self.started_at = time.monotonic()

    def other(self):
        self.started_at = time.monotonic()
"""


@pytest.fixture(scope="module")
def mutations(import_bench):
    return import_bench("mutations")


def test_every_mutation_is_found_once_and_planted(mutations, capsys):
    assert mutations.main(["--check"]) == 0
    assert capsys.readouterr().out == f"{len(mutations.MUTATIONS)} mutations found and planted\n"


def test_a_mutation_is_found_by_syntax_within_its_function_only(mutations):
    planted = mutations.mutate_source(SOURCE, "Saves.begin", "self.started_at = time.monotonic()", "")
    assert planted.count("self.started_at = time.monotonic()") == 1  # other()'s is left
    swapped = mutations.mutate_source(SOURCE, "Saves.begin", "self.start(progress)", "self.start(None)")
    assert "self.pending = self.start(None)" in swapped


@pytest.mark.parametrize(
    ("function", "old", "message"),
    [
        ("Saves.end", "x", "no single definition of 'end' (of Saves.end): 0 found"),
        (
            "Saves.begin",
            "self.started_at = time.time()",
            "Saves.begin holds 'self.started_at = time.time()' 0",
        ),
        ("Saves.begin", "self", "Saves.begin holds 'self' 3 times, not once"),
    ],
)
def test_a_mutation_that_finds_no_single_target_stops_the_script(mutations, function, old, message):
    with pytest.raises(mutations.MutationNotFound, match=re.escape(message)):
        mutations.mutate_source(SOURCE, function, old, "None" if old == "self" else "")
