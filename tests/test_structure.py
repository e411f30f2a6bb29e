"""The code's shape: no import cycle of any kind (module-level, inside functions or under TYPE_CHECKING), no
argparse below ``cli.py`` and ``commands/``, no module over 600 lines (a concept stays in one module rather
than being cut by a line count), no function over 60, and no history in comments, docstrings or docs. Read
from the source with ``ast`` and ``tokenize``, nothing imported."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "cona"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 60


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of the package that ``path`` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in known:
                    found.add(full)
                elif node.module in known:
                    found.add(node.module)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative enough for this size)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_of_any_kind() -> None:
    known = modules()
    graph = {name: imported(path, known) - {name} for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def imports_argparse(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            return True
    return False


def test_argparse_only_in_the_command_line_layer() -> None:
    outside = [
        name
        for name, path in modules().items()
        if name != "cona.cli" and not name.startswith("cona.commands") and imports_argparse(path)
    ]
    assert outside == []


def test_modules_and_functions_stay_short() -> None:
    long_modules, long_functions = [], []
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name} ({length} lines)")
    assert (long_modules, long_functions) == ([], [])


# No history in the code: comments, docstrings and docs state the rule, its reason and its units. Which issue,
# session, call, commit or run showed a thing belongs in a commit message or on docs/benchmarks.md's results.
ROOT = SRC.parent
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth"
    "|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-[a-z]+|thirtieth|\\d+(?:st|nd|rd|th)"
)
HISTORY = {
    "an issue number": re.compile(r"\bissues?\s+#?\d+|(?<![\w&])#\d+\b", re.IGNORECASE),
    "a session": re.compile(rf"\b(?:{ORDINALS})\s+session", re.IGNORECASE),
    "a call number": re.compile(r"\bcalls?\s+\d+", re.IGNORECASE),
    "a commit hash": re.compile(r"(?<![\w.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])"),
    # A run named by a letter and a number: after "run", possessive, a range of them, or last in a
    # parenthesis after a comma. Alone such a token is code or hardware (x86, h100, SwiGLU's weights).
    "a run id": re.compile(
        r"\bruns?\s+[a-z]\d{1,3}\b|\b[a-z]\d{1,3}'s\b|\b\d+,\s*[a-z]\d{1,3}\)|\b[a-z]\d{1,3}-[a-z]\d{1,3}\b"
    ),
}
EXTERNAL_COMMITS = {"676a482c", "6acc370a", "f4157bea"}
"""Megatron-DeepSpeed's commits, not ours: the one that changed its fused-QKV layout (the backend names it in
its errors), one before it and one after it, which the backend's docs and tests were checked against."""


def prose(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a Python file (string statements, attribute docstrings included), or
    the whole of a Markdown file, as (first line, text)."""
    text = path.read_text()
    if path.suffix != ".py":
        return [(1, text)]
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found.append((node.lineno, node.value.value))
    return found


def history_in(path: Path) -> list[str]:
    """``line: what (match)`` for each citation of the project's history in ``path``'s prose."""
    hits = []
    for line, text in sorted(prose(path)):
        for what, pattern in HISTORY.items():
            for match in pattern.finditer(text):
                if what != "a commit hash" or match.group() not in EXTERNAL_COMMITS:
                    at = line + text.count("\n", 0, match.start())
                    hits.append(f"{at}: {what} ({match.group()!r})")
    return hits


def scanned_files() -> list[Path]:
    """Every .py file of src/, tests/ and bench/, the README and docs/*.md but the benchmark results page
    (which names the commit and date its numbers were measured at)."""
    files = [path for folder in ("src", "tests", "bench") for path in sorted((ROOT / folder).rglob("*.py"))]
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [*files, ROOT / "README.md", *(path for path in docs if path.name != "benchmarks.md")]


def test_no_history_in_code_or_docs() -> None:
    hits = [f"{path.relative_to(ROOT)}:{hit}" for path in scanned_files() for hit in history_in(path)]
    assert hits == [], "\n".join(hits)


def test_the_history_check_sees_history(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""Kept since issue 16 (see #27)."""\n'
        "X = 1  # the twenty-ninth session and the 3rd session measured it\n"
        "Y = 2\n"
        '"""From call 9 at 71b8648, confirmed by run e23 (issue 16, e24); e23\'s rate; e21-e24."""\n'
        "def f(e5=1e5, x86=None, bf16='bf16', h100='H100'):  # e5, x86, fp16, bf16 and h100 are code\n"
        '    """Scale by 1e5 on x86 and an H100 (``w1``/``w2``, ``m0``); call it; cdcdcdcd; 676a482c."""\n'
    )
    assert history_in(planted) == [
        "1: an issue number ('issue 16')",
        "1: an issue number ('#27')",
        "2: a session ('twenty-ninth session')",
        "2: a session ('3rd session')",
        "4: an issue number ('issue 16')",
        "4: a call number ('call 9')",
        "4: a commit hash ('71b8648')",
        "4: a run id ('run e23')",
        "4: a run id ('16, e24)')",
        '4: a run id ("e23\'s")',
        "4: a run id ('e21-e24')",
    ]
