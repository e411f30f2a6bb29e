"""Plain text out of the corpora's packaged files: HTML, POD, Vim help, fortune files, a dictd file, the doc
strings of API description files (JSON), the docstrings of Python sources (read by ``ast``: nothing runs).

Each function takes the bytes of one file and returns text, or (for the containers) a list of documents.
Bytes are decoded as UTF-8 with ``errors="replace"``: a few packaged files hold stray Latin-1 bytes, and
one bad byte must not cost a whole file. The markup is stripped only as far as a reader would not see it
(tags, POD commands and formatting codes, Vim's ``*tag*`` anchors); code samples stay, as in real docs.
"""

from __future__ import annotations

import gzip
import html
import html.parser
import re

GCIDE_DOCUMENT_CHARS = 16_000
"""gcide entries are a few hundred characters each; ~16k characters of consecutive entries make one document,
so the corpus has documents of a length like the other sources' instead of 200k tiny ones."""


def decode(data: bytes) -> str:
    """UTF-8 text of ``data`` (gunzipped first when it is gzip, as Debian's ``*.gz`` docs are)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def tidy(text: str) -> str:
    """Trailing spaces off, runs of blank lines down to one, no leading/trailing blank lines."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


class _TextOfHtml(html.parser.HTMLParser):
    """Collects the visible text; block elements end a line, so paragraphs stay apart."""

    SKIPPED = frozenset({"script", "style", "head", "nav", "noscript", "svg"})
    BLOCKS = frozenset(
        {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "table", "dt", "dd",
         "blockquote", "section", "title", "hr"}
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_depth = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self.SKIPPED:
            self.skip_depth += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIPPED:
            self.skip_depth = max(0, self.skip_depth - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.skip_depth:
            self.parts.append(data)


def html_text(data: bytes) -> str:
    parser = _TextOfHtml()
    parser.feed(decode(data))
    parser.close()
    # Inline whitespace from the source layout collapses; the line breaks the block elements made stay.
    lines = (re.sub(r"[ \t\xa0]+", " ", line).strip() for line in "".join(parser.parts).split("\n"))
    return tidy("\n".join(lines))


_POD_CODE = re.compile(r"[BICFSXZL]<(?!<)([^<>]*)>")
_POD_WIDE_CODE = re.compile(r"[BICFSXZL]<{2,}\s+(.*?)\s+>{2,}", re.DOTALL)
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def _pod_link(match: re.Match) -> str:
    inner = match.group(1)
    text = inner.split("|", 1)[0] if "|" in inner else inner
    return text


def pod_text(data: bytes) -> str:
    """POD without its commands (``=head1 X`` keeps X) and formatting codes (``C<x>`` keeps x)."""
    kept = []
    skipping = False  # inside =begin ... =end (formatter-specific blocks) or before =pod after =cut
    for line in decode(data).split("\n"):
        if line.startswith("="):
            command, _, rest = line[1:].partition(" ")
            skipping = command == "begin"
            if command.startswith("head") or command == "item":
                kept.append(rest.strip())
            continue
        if not skipping:
            kept.append(line)
    text = "\n".join(kept)
    text = re.sub(r"E<(\w+)>", lambda m: _POD_ESCAPES.get(m.group(1), html.unescape(f"&{m.group(1)};")), text)
    text = _POD_WIDE_CODE.sub(lambda m: m.group(1), text)
    for _ in range(4):  # nested codes (B<C<x>>) come off one level per pass
        text = _POD_CODE.sub(_pod_link, text)
    return tidy(text)


def vim_help_text(data: bytes) -> str:
    """Vim help without its hyperlink markup: ``*tag*`` anchors dropped, ``|link|`` kept as the word."""
    text = decode(data)
    text = re.sub(r"(?<!\S)\*[^\s*|]+\*(?!\S)", "", text)
    text = re.sub(r"\|([^\s|]+)\|", r"\1", text)
    text = re.sub(r"^[ \t]*vim:.*$", "", text, flags=re.MULTILINE)  # modelines
    return tidy(text)


def fortunes(data: bytes) -> list[str]:
    """One fortune file (sayings separated by lines of ``%``) as one document of its sayings."""
    sayings = [tidy(part) for part in re.split(r"^%\s*$", decode(data), flags=re.MULTILINE)]
    return ["\n\n".join(s for s in sayings if s)]


_DICTD_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(encoded: str) -> int:
    """dictd's index numbers: base 64 in its own digit order (``A`` = 0, ``/`` = 63)."""
    value = 0
    for char in encoded:
        value = value * 64 + _DICTD_DIGITS.index(char)
    return value


def dictd_documents(dictionary: bytes, index: bytes) -> list[str]:
    """A dictd dictionary's entries (metadata entries ``00-database-*`` left out), in the file's order,
    joined into documents of about :data:`GCIDE_DOCUMENT_CHARS` characters."""
    text = gzip.decompress(dictionary) if dictionary[:2] == b"\x1f\x8b" else dictionary
    spans = set()
    for line in decode(index).splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and not fields[0].startswith("00-database"):
            spans.add((dictd_number(fields[1]), dictd_number(fields[2])))
    documents, current, size = [], [], 0
    for start, length in sorted(spans):
        entry = tidy(text[start : start + length].decode("utf-8", errors="replace"))
        current.append(entry)
        size += len(entry)
        if size >= GCIDE_DOCUMENT_CHARS:
            documents.append("\n\n".join(current))
            current, size = [], 0
    if current:
        documents.append("\n\n".join(current))
    return documents


_TAG = re.compile(r"<[^>]+>")


def api_doc_strings(data: bytes, key: str) -> list[str]:
    """Every string under ``key`` (at any depth) of an API description file (JSON, gzipped or not), its
    HTML tags stripped and whitespace collapsed, in file order: the prose of AWS service models
    (``documentation``) and Google discovery documents (``description``)."""
    import json

    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                if name == key and isinstance(value, str):
                    found.append(" ".join(html.unescape(_TAG.sub(" ", value)).split()))
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(decode(data)))
    return [text for text in found if text]


def python_docstrings(data: bytes) -> list[str]:
    """The paragraphs of the module, class and function docstrings of one Python source, parsed (never run);
    a file that does not parse gives none."""
    import ast

    try:
        tree = ast.parse(decode(data))
    except (SyntaxError, ValueError):
        return []
    paragraphs: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)
            if text:
                paragraphs += [tidy(part) for part in re.split(r"\n\s*\n", text) if part.strip()]
    return paragraphs
