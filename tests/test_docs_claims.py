"""What the docs say about the repository is true: every file, flag, patch number, patch count
and section they name exists. Fast: reads text and builds the launcher's parser, nothing else.

Docs checked (DOCS): README.md, WALLS.md, docs/*.md, docs/families/*.md, bench/README.md, bench/RESULTS.md. The rules:

- **Paths.** A markdown link `[text](target)` (or image) is resolved from the doc's folder and must
  exist; a `#fragment` must be the slug of a heading of the page it points to (GitHub's slug:
  lowercase, punctuation dropped, spaces to hyphens). URLs (`scheme:...`) are not checked. An
  inline code span without spaces is a repository path when its first component is a top-level
  entry of the repository (TOP: `launcher/...`, `bench/...`, `presets/x.yaml`, `WALLS.md`, ...), resolved
  from the repository root, or, in a doc below the root, an entry of the doc's own folder
  (`archive/...`, `results/...` in bench/), resolved from there. `<name>` and an all-capitals
  word (`NAME`, `DIR`, `notes-DATE-NAME.md`) are placeholders, `*` a wildcard, `{a,b}`
  alternatives: at least one file must match. `presets/NAME.yaml` of a merged card preset's old
  name (`old_name` in presets/cards.csv) holds: the name still runs its preset. Every other path is
  not a claim about this repository and is not checked: a workdir or run placeholder (`W/venv`, `<run>/samples/`, `DIR/trainer`,
  `.aitk/trainer`), the trainer checkout's own tree, which the docs write without a repository
  folder (`toolkit/int4_linear.py`, `run.py`; the project's copies are under `overlay/`), and
  other programs' folders (ComfyUI's `models/loras/`). A bare test file name
  (`test_heap_trim.py`) must be a file under tests/.
- **Flags.** In code (fenced or indented blocks, inline spans), every `--flag` after
  `python -m launcher COMMAND [VERB]`, up to the end of that command (`&&`, `;`, a `#` comment
  or the next `python`), must be an option of that command's parser in `launcher.cli`, spelled
  out (no abbreviations). An inline span that starts with a command's name (`run --resume`)
  counts as that command.
- **Patch numbers.** A patch number (`0027`, a range `0016-0019`, a file name
  `0003-flux2-stream-....patch`) must exist in the series it refers to: upstream-main when
  "upstream"/"upstream-main" is the nearest target word before it in its paragraph (within
  CONTEXT characters), amd-fork when "fork"/"amd-fork" is; otherwise the series of its
  section, upstream-main under a heading that names upstream, amd-fork elsewhere.
  A patch slug written as code right after the word "patch" must be a patch of some series.
- **Counts.** "N patches" (and "all N", "of the N patches") must be the length of that series:
  write a range or "every patch" for a series as it stood on a past date.
- **Sections.** A reference to a section of a markdown page (`RESULTS.md, "Slice size"`,
  `[recipe.md](recipe.md), "The stall"`, `RESULTS.md ("The memory plan")`, a preset's
  `(README: See samples)`), in the docs, the presets and the code, must start a heading of
  that page.

Each check reports every offender at once as `file:line: what`.
"""

import argparse
import re
import sys
from pathlib import Path

import pytest

from launcher import __version__
from launcher.card_table import old_names, read_cards
from launcher.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "WALLS.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")),
        *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs" / "families").glob("*.md")),
        "bench/README.md", "bench/RESULTS.md"]
TOP = {"launcher", "bench", "tests", "overlay", "patches", "presets", "docs", ".ci", "README.md", "WALLS.md",
       "CHANGELOG.md", "pyproject.toml", "upstream.lock"}
CONTEXT = 60
OLD_NAMES = set(old_names(read_cards()))
SERIES = {name: [line.strip().removesuffix(".patch") for line in
                 (REPO / "patches" / name / "series").read_text(encoding="utf-8").splitlines()
                 if line.strip() and not line.startswith("#")]
          for name in ("amd-fork", "upstream-main")}
README_TEST_COMMAND = 'pip install -e ".[test]" && ruff check . && python -m pytest'
CODE_SCANNED_FOR_SECTIONS = ["presets/*.yaml", "launcher/**/*.py", "overlay/**/*.py", "bench/*.py", "bench/*.sh",
                             "bench/archive/*.py", "bench/archive/*.sh"]


# ---------------------------------------------------------------------------------------------
# reading markdown


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def code_and_prose(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(code, prose): code as (offset, logical line) for fenced and indented blocks (a line
    ending in a backslash joined with the next) and (offset, span) for inline spans; prose as
    (offset, line) for every line outside blocks."""
    code, prose, fenced, offset = [], [], False, 0
    pending = None
    for line in text.split("\n"):
        start, offset = offset, offset + len(line) + 1
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            if pending:
                pending = (pending[0], pending[1][:-1] + " " + line.strip())
            else:
                pending = (start, line.strip())
            if not pending[1].endswith("\\"):
                code.append(pending)
                pending = None
            continue
        prose.append((start, line))
        for span in re.finditer(r"`([^`]+)`", line):
            code.append((start + span.start(1), span.group(1)))
    return code, prose


def slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    _, prose = code_and_prose(text)
    return [re.sub(r"^#+\s*", "", line).strip() for _, line in prose if re.match(r"#{1,6} ", line)]


# ---------------------------------------------------------------------------------------------
# the checks: each takes a doc's name and text and returns "name:line: what" for each offender


def expand(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [p for choice in match.group(1).split(",")
            for p in expand(pattern[:match.start()] + choice + pattern[match.end():])]


def path_exists(base: Path, path: str) -> bool:
    parts = []
    for part in path.rstrip("/").split("/"):
        part = re.sub(r"<[^>]*>", "*", part)
        parts.append(re.sub(r"(?<![A-Za-z0-9])[A-Z][A-Z_]+(?![A-Za-z0-9])", "*", part))
    for candidate in expand("/".join(parts)):
        if any(ch in candidate for ch in "*?["):
            if any(base.glob(candidate)):
                return True
        elif (base / candidate).exists():
            return True
    return False


def check_paths(name: str, text: str, repo: Path = REPO) -> list[str]:
    doc = repo / name
    found = []
    _, prose = code_and_prose(text)
    for start, line in prose:
        for link in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", line):
            target = link.group(1)
            where = f"{name}:{line_of(text, start)}"
            if re.match(r"[a-zA-Z][\w+.-]*:", target):
                continue
            path, _, fragment = target.partition("#")
            page = (doc.parent / path).resolve() if path else doc
            relative = page.relative_to(repo).as_posix() if page.is_relative_to(repo) else str(page)
            if not page.exists():
                found.append(f"{where}: link to {target}: {relative} does not exist")
                continue
            if fragment and page.suffix == ".md" and fragment not in {slug(h) for h in headings(page)}:
                found.append(f"{where}: link to {target}: {relative} has no heading #{fragment}")
        for span in re.finditer(r"`([^`\s]+)`", line):
            where = f"{name}:{line_of(text, start)}"
            path = span.group(1).split("::")[0].rstrip(".,;:")
            if "://" in path or path.startswith(("-", "<", ".aitk")):
                continue
            if re.fullmatch(r"test_\w+\.py", path):
                if not any((repo / "tests").rglob(path)):
                    found.append(f"{where}: `{path}` is no file under tests/")
                continue
            if "/" not in path and path not in TOP:
                continue
            first = path.split("/")[0]
            if first in TOP:
                base = repo
            elif doc.parent != repo and first and (doc.parent / first).exists():
                base = doc.parent
            else:
                continue
            if path.startswith("presets/") and path.removeprefix("presets/").removesuffix(".yaml") in OLD_NAMES:
                continue  # a merged card preset's old name still runs its preset (presets/cards.csv)
            if not path_exists(base, path):
                found.append(f"{where}: `{path}` does not exist (from {base.relative_to(repo).as_posix() or '.'})")
    return found


def subcommands(parser: argparse.ArgumentParser) -> dict:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


COMMANDS = subcommands(build_parser())


def check_flags(name: str, text: str) -> list[str]:
    found = []
    code, _ = code_and_prose(text)
    for start, segment in code:
        tokens = segment.split()
        starts = [i + 2 for i in range(len(tokens) - 2) if tokens[i] == "-m" and tokens[i + 1] == "launcher"]
        if tokens and tokens[0] in COMMANDS and len(tokens) > 1:
            starts.append(0)
        for first in starts:
            command = tokens[first].strip("`")
            if re.fullmatch(r"[A-Z_]+|\.\.\.", command):
                continue
            where = f"{name}:{line_of(text, start)}"
            if command not in COMMANDS:
                found.append(f"{where}: `python -m launcher {command}`: no such command")
                continue
            parser, words, rest = COMMANDS[command], [command], tokens[first + 1:]
            if rest and rest[0] in subcommands(parser):
                parser, words, rest = subcommands(parser)[rest[0]], words + [rest[0]], rest[1:]
            options = {o for action in parser._actions for o in action.option_strings}
            for token in rest:
                if token in ("&&", ";", "||") or token.startswith("#") or re.search(r"(^|/)python3?$", token):
                    break
                for piece in token.split("|"):
                    flag = piece.strip("[](),`'\"").split("=")[0]
                    if re.fullmatch(r"--[a-z][\w-]*", flag) and flag not in options:
                        found.append(f"{where}: `python -m launcher {' '.join(words)}` has no {flag}")
    return found


def series_at(text: str, offset: int, default: str) -> str:
    window = text[max(0, offset - CONTEXT):offset].split("\n\n")[-1]
    words = re.findall(r"upstream[- ]main|upstream|amd-fork|fork", window, re.I)
    if not words:
        return default
    return "upstream-main" if words[-1].lower().startswith("upstream") else "amd-fork"


def section_defaults(text: str) -> list[tuple[int, str]]:
    """(offset, series) at each heading: upstream-main under a heading that names upstream."""
    marks = [(0, "amd-fork")]
    for heading in re.finditer(r"^#{1,6} (.*)$", text, re.M):
        marks.append((heading.start(), "upstream-main" if "upstream" in heading.group(1).lower() else "amd-fork"))
    return marks


def check_patches(name: str, text: str) -> list[str]:
    found, marks = [], section_defaults(text)

    def series_for(offset):
        default = [series for at, series in marks if at <= offset][-1]
        return series_at(text, offset, default)

    taken = set()
    for match in re.finditer(r"(?<![\w.])(00\d\d)-([A-Za-z][^\s`,;()]*)", text):
        taken.add(match.start(1))
        series = series_for(match.start())
        where = f"{name}:{line_of(text, match.start())}"
        slug_ = match.group(2).removesuffix(".patch").rstrip(".")
        if match.group(2).startswith("..."):
            if int(match.group(1)) > len(SERIES[series]):
                found.append(f"{where}: patch {match.group(1)} is not in {series} ({len(SERIES[series])} patches)")
        elif not any(p == f"{match.group(1)}-{slug_}" or (p.startswith(f"{match.group(1)}-{slug_}")
                                                           and match.group(2).endswith("..."))
                     for p in SERIES[series]):
            found.append(f"{where}: {match.group(0)} is no patch of {series}")
    for match in re.finditer(r"(?<![\w.\-/])(00\d\d)(?:-(00\d\d))?(?![\w.])", text):
        if match.start(1) in taken:
            continue
        series = series_for(match.start())
        for number in filter(None, match.groups()):
            if not 1 <= int(number) <= len(SERIES[series]):
                found.append(f"{name}:{line_of(text, match.start())}: patch {number} is not in {series} "
                             f"({len(SERIES[series])} patches)")
    for match in re.finditer(r"\bpatch `([^`\s]+)`", text):
        slug_ = match.group(1).removesuffix(".patch")
        if not any(p == slug_ or p.split("-", 1)[1] == slug_ for patches in SERIES.values() for p in patches):
            found.append(f"{name}:{line_of(text, match.start())}: patch `{slug_}` is in no series")
    for match in re.finditer(r"\b(?:all |of the |the )?(\d+) patches\b", text):
        series = series_for(match.start())
        if int(match.group(1)) != len(SERIES[series]):
            found.append(f"{name}:{line_of(text, match.start())}: \"{match.group(0)}\": {series} has "
                         f"{len(SERIES[series])}; name a range or say \"every patch\"")
    return found


SECTION_REFERENCE = re.compile(
    r"(?:\[[^\]]*\]\(([^)\s#]+\.md)[^)]*\)|`?([\w./-]+\.md)`?)(?:,\s*|\s*\(\s*)\"([^\"]+)\"")


def find_page(source: Path, name: str, repo: Path = REPO) -> Path | None:
    for base in (source.parent, repo):
        if (base / name).is_file():
            return base / name
    named = [repo / doc for doc in DOCS if Path(doc).name == Path(name).name]
    return named[0] if len(named) == 1 else None


def check_sections(name: str, text: str, repo: Path = REPO) -> list[str]:
    found, source = [], repo / name
    references = [(m.start(), m.group(1) or m.group(2), m.group(3)) for m in SECTION_REFERENCE.finditer(text)]
    references += [(m.start(), "README.md", m.group(1)) for m in re.finditer(r"\(README: ([^)]+)\)", text)]
    for offset, page_name, title in references:
        page = find_page(source, page_name, repo)
        if page is None:
            continue
        title = " ".join(title.replace("`", "").split()).lower()
        if not any(" ".join(h.replace("`", "").split()).lower().startswith(title) for h in headings(page)):
            found.append(f"{name}:{line_of(text, offset)}: {page_name} has no section \"{title}\"")
    return found


# ---------------------------------------------------------------------------------------------
# the docs


def read(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("check", [check_paths, check_flags, check_patches, check_sections],
                         ids=lambda f: f.__name__)
def test_every_claim_in_the_docs_holds(check):
    found = [offender for name in DOCS for offender in check(name, read(name))]
    assert not found, f"{len(found)} claim(s) in the docs do not hold:\n" + "\n".join(found)


def test_section_references_in_presets_and_code_hold():
    names = sorted({p.relative_to(REPO).as_posix() for pattern in CODE_SCANNED_FOR_SECTIONS
                    for p in REPO.glob(pattern)})
    assert "presets/7900xtx_512.yaml" in names
    found = [offender for name in names for offender in check_sections(name, read(name))]
    assert not found, "\n".join(found)


def test_the_top_level_entries_exist():
    assert all((REPO / entry).exists() for entry in TOP)


def test_readme_is_a_front_page():
    lines = read("README.md").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move a section to docs/"
    long = [number for number, line in enumerate(lines, 1) if len(line) > 200]
    assert not long, f"README.md lines {long} are over 200 characters: a front page is read, not scrolled sideways"


def test_the_readme_test_command_is_what_ci_runs():
    assert README_TEST_COMMAND in read("README.md").splitlines()
    assert README_TEST_COMMAND in read(".ci/run").splitlines()


def results_prose(text: str) -> list[str]:
    """The hand-written lines of RESULTS.md: outside the generated tables and fenced code."""
    prose, generated, fenced = [], False, False
    for line in text.splitlines():
        if line.startswith("<!-- results: "):
            generated = True
        elif line == "<!-- end results -->":
            generated = False
        elif line.startswith("```"):
            fenced = not fenced
        elif not generated and not fenced:
            prose.append(line)
    return prose


def test_results_md_is_tables_with_a_paragraph_each():
    prose = results_prose(read("bench/RESULTS.md"))
    assert len(prose) <= 300, f"bench/RESULTS.md has {len(prose)} hand-written lines; move notes to bench/archive/"


# ---------------------------------------------------------------------------------------------
# the checks catch what they are for


def test_a_missing_file_a_wrong_link_and_a_missing_test_are_caught(tmp_path):
    text = ("See `launcher/no_such_module.py` and [the guide](docs/nowhere.md), `test_no_such_test.py`,\n"
            "[commands](docs/commands.md#no-such-heading); fine: `launcher/cli.py`, `W/venv`, `toolkit/x.py`,\n"
            "`presets/NAME.yaml`, `patches/<target>/series`, [options](docs/options.md).\n")
    found = check_paths("README.md", text)
    assert len(found) == 4, found
    assert "README.md:1: `launcher/no_such_module.py` does not exist (from .)" in found
    assert any("docs/nowhere.md does not exist" in f for f in found)
    assert any("no heading #no-such-heading" in f for f in found)


def test_a_flag_a_command_does_not_take_is_caught():
    text = ("```\npython -m launcher run presets/tiny.yaml --resum --dry-run\n"
            "python -m launcher patches check --json --write   # a comment --not-checked\n```\n"
            "Use `setup --torch-channel cpu` or `run --no-such-flag`; `python -m launcher nonsense`.\n")
    found = check_flags("README.md", text)
    assert found == ["README.md:2: `python -m launcher run` has no --resum",
                     "README.md:3: `python -m launcher patches check` has no --write",
                     "README.md:5: `python -m launcher run` has no --no-such-flag",
                     "README.md:5: `python -m launcher nonsense`: no such command"], found


def test_a_patch_number_a_count_and_a_slug_that_do_not_exist_are_caught(monkeypatch):
    fork, last = SERIES["amd-fork"], len(SERIES["upstream-main"])
    # a number the fork has and upstream main has not, whatever the two series' lengths are now
    monkeypatch.setitem(SERIES, "amd-fork", fork + [f"00{n:02d}-more" for n in range(len(fork) + 1, last + 2)])
    fork_last = len(SERIES["amd-fork"])
    text = (f"amd-fork 00{fork_last:02d} and upstream-main 00{last:02d} exist; upstream-main 00{last + 1:02d} does not,\n"
            "nor patch 0099, nor `0003-flux2-no-such-patch.patch`, nor patch `no-such-slug`.\n"
            f"The series has 11 patches.\n\n## On upstream main\n\nHere 00{fork_last:02d} is upstream's.\n")
    found = check_patches("WALLS.md", text)
    assert len(found) == 6, found
    assert f"WALLS.md:1: patch 00{last + 1:02d} is not in upstream-main ({last} patches)" in found
    assert any(f.startswith(f"WALLS.md:7: patch 00{fork_last:02d} is not in upstream-main") for f in found)


def test_a_reference_to_a_missing_section_is_caught():
    text = ('See bench/RESULTS.md, "The memory plan", and bench/RESULTS.md ("No such section");\n'
            '[recipe](docs/recipe.md), "The stall"; (README: See samples) and (README: Nothing here).\n')
    found = check_sections("README.md", text)
    assert found == ['README.md:1: bench/RESULTS.md has no section "no such section"',
                     'README.md:2: README.md has no section "nothing here"'], found


def test_results_prose_leaves_out_tables_and_code():
    text = "a\n<!-- results: t -->\n| x |\n<!-- end results -->\n```\ncode\n```\nb\n"
    assert results_prose(text) == ["a", "b"]


# ---------------------------------------------------------------------------------------------
# the changelog


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def changelog_versions() -> list[tuple[int, str, str]]:
    """(line, version, date) of each released section of CHANGELOG.md, top down."""
    found = []
    for number, line in enumerate(read("CHANGELOG.md").splitlines(), 1):
        if line.startswith("## ") and line != "## Unreleased":
            match = re.fullmatch(r"## (\d+\.\d+\.\d+) - (\d{4}-\d\d-\d\d)", line)
            assert match, f"CHANGELOG.md:{number}: a version header is `## X.Y.Z - YYYY-MM-DD`, not {line!r}"
            found.append((number, match.group(1), match.group(2)))
    return found


def test_the_changelog_is_released_newest_first_up_to_the_package_version():
    """The newest released version is launcher.__version__, or below it while an Unreleased
    section lists the version being made."""
    released = changelog_versions()
    assert released, "CHANGELOG.md has no released version"
    newest = version(released[0][1])
    assert newest <= version(__version__), (
        f"CHANGELOG.md's newest version {released[0][1]} is above launcher.__version__ {__version__}")
    if "## Unreleased" in read("CHANGELOG.md").splitlines():
        assert newest < version(__version__), (
            f"launcher.__version__ {__version__} is released already: bump it for the Unreleased changes")
    else:
        assert newest == version(__version__), f"launcher.__version__ {__version__} is not in CHANGELOG.md"
    for (line, newer, newer_date), (_, older, older_date) in zip(released, released[1:]):
        assert version(newer) > version(older), f"CHANGELOG.md:{line}: {newer} is not above the {older} below it"
        assert newer_date >= older_date, f"CHANGELOG.md:{line}: {newer} is dated before {older}"


def test_unreleased_changes_come_first():
    headers = [line for line in read("CHANGELOG.md").splitlines() if line.startswith("## ")]
    assert "## Unreleased" not in headers[1:], "`## Unreleased` belongs at the top of CHANGELOG.md"


if __name__ == "__main__":  # every offender of the docs, without pytest
    offenders = [o for check in (check_paths, check_flags, check_patches, check_sections)
                 for name in DOCS for o in check(name, read(name))]
    print("\n".join(offenders))
    sys.exit(1 if offenders else 0)
