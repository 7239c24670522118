"""The documentation's relative links resolve, and the README stays a front page.

Every relative link in README.md, ARCHITECTURE.md, CHANGELOG.md and docs/*.md must name a file or folder
of the repository, and a `#anchor` must name a heading of the markdown file it points to, slugged the way
GitHub renders headings (lower case; punctuation other than `-` and `_` dropped; spaces to `-`; a repeated
heading gets `-1`, `-2`, ...). Links inside code blocks and code spans are not links and are skipped; web
addresses are not checked (no network in CI).
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target may be followed by a "title". Nested brackets in the text
# (a badge inside a link) are not used in these docs.
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")      # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "CHANGELOG.md"]
    files += sorted((REPO / "docs").glob("*.md"))
    return [f for f in files if f.exists()]


def outside_fences(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    in_fence = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            if in_fence is None:
                in_fence = fence.group(1)
            elif fence.group(1) == in_fence:
                in_fence = None
            continue
        if in_fence is None:
            yield number, line


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, code spans blanked out."""
    for number, line in outside_fences(text):
        yield number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link's text stays, its address goes
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML
    text = text.replace("`", "")
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)         # emphasis markers, not snake_case
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)                         # keeps letters (π too), digits, _ and -
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in outside_fences(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path):
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in INLINE_LINK.findall(line):
            yield number, target
        definition = REFERENCE_DEF.match(line)
        if definition:
            yield number, definition.group(1)


def broken_links(paths) -> list[str]:
    """'file:line: target (why)' for every relative link that does not resolve."""
    problems = []
    anchor_cache: dict[Path, set[str]] = {}
    for path in paths:
        for number, target in links(path):
            if not target or EXTERNAL.match(target):
                continue
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{number}"
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if file_part and not resolved.exists():
                problems.append(f"{where}: {target} (no such file)")
                continue
            if anchor:
                if resolved.suffix != ".md" or resolved.is_dir():
                    problems.append(f"{where}: {target} (an anchor into something that is not a markdown file)")
                    continue
                if resolved not in anchor_cache:
                    anchor_cache[resolved] = anchors(resolved)
                if anchor not in anchor_cache[resolved]:
                    problems.append(f"{where}: {target} (no heading with the anchor #{anchor} in {resolved.name})")
    return problems


def test_every_relative_link_in_the_docs_resolves():
    files = doc_files()
    assert REPO / "README.md" in files and len(files) > 3
    problems = broken_links(files)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_the_checker_finds_broken_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Fleet: `N` robots (one engine)\n\n## Notes\n\n## Notes\n")
    (tmp_path / "page.md").write_text(
        "# Page\n\n"
        "[ok](other.md) [ok](other.md#fleet-n-robots-one-engine) [ok](other.md#notes-1) [ok](#page)\n"
        "[gone](missing.md) [bad anchor](other.md#fleet) [self](#nowhere) ![img](nothing.png)\n"
        "`[in a code span](missing2.md)` [web](https://example.com/x.md)\n\n"
        "```\n[in a code block](missing3.md)\n```\n\n"
        "[ref]: missing4.md\n")
    problems = broken_links([tmp_path / "page.md"])
    targets = sorted(p.split(": ", 1)[1].split(" (")[0] for p in problems)
    assert targets == sorted(["missing.md", "other.md#fleet", "#nowhere", "nothing.png", "missing4.md"]), problems


def test_github_heading_slugs():
    assert github_slug("The demo model: a small π0.5 trained here") == "the-demo-model-a-small-π05-trained-here"
    assert github_slug("Preparing images ahead of the cycle (`prepare_ahead`)") == \
        "preparing-images-ahead-of-the-cycle-prepare_ahead"
    assert github_slug("One engine, many robots") == "one-engine-many-robots"
    assert github_slug("**Bold** and [a link](x.md)") == "bold-and-a-link"


# The project speaks of itself, not of the machine it was built on: no absolute path of the machine that
# holds this checkout (the folder it lies in, the administrator's and users' homes; a user's checkout is
# anywhere: paths are relative, or placeholders like <repo>). Derived from where the checkout lies, so that no
# such path is written here either.
def build_environment(checkout: Path = REPO) -> re.Pattern:
    roots = ["root", r"home/[\w.-]+"]
    if checkout.parent != Path(checkout.anchor):          # a checkout at the top of the file system: no folder
        roots.append(re.escape(str(checkout.parent).strip("/")))
    return re.compile(rf"(?<![\w.~-])/(?:{'|'.join(roots)})/")


BUILD_ENVIRONMENT = build_environment()
SCANNED = ("README.md", "ARCHITECTURE.md", "CHANGELOG.md", "docs/*.md", "docs/*.json", "scripts/*", "config/*",
           "oxygen_ros/**/*.py", "oxygen_ros/**/*.html", "oxygen_ros/**/*.yaml", "kernels/**/*.py",
           "launch/*", "test/*.py")


def build_paths(paths) -> list[str]:
    """'file:line: text' for every line with an absolute path of a build machine."""
    found = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, IsADirectoryError):
            continue                                # binary files (pictures, weights): no prose
        for number, line in enumerate(text.splitlines(), 1):
            if BUILD_ENVIRONMENT.search(line):
                where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                found.append(f"{where}:{number}: {line.strip()[:160]}")
    return found


def test_the_project_speaks_of_itself_not_of_its_build_environment():
    files = sorted({f for pattern in SCANNED for f in REPO.glob(pattern) if f.is_file()})
    assert any(f.name == "gpu.md" for f in files) and any(f.suffix == ".sh" for f in files)
    found = build_paths(files)
    assert not found, "build-machine paths:\n" + "\n".join(found)


def test_the_environment_check_finds_build_paths(tmp_path):
    page = tmp_path / "page.md"
    beside = REPO.parent / "side" / "lerobot061"              # a folder next to this checkout
    home = Path("/", "home", "ci")                            # joined: this file is scanned too
    page.write_text(f"python3.12 -m venv {beside}\n"                     # flagged: a build path
                    f"PYTHON={home}/.pyenv/versions/3.12.1/bin/python3.12\n"   # flagged: a home
                    "python3.12 -m venv ../lerobot061 && ~/work/x /tmp/bag\n"  # relative, a home, a user's tmp
                    "see docs/work/notes.md and https://example.org/home/x/\n")  # a relative path, a URL
    found = build_paths([page])
    assert [f.split(":")[1] for f in found] == ["1", "2"], found
    elsewhere = build_environment(Path("/srv/ci/checkout/oxygen_ros"))   # wherever the checkout lies
    assert elsewhere.search(" /srv/ci/checkout/x") and not elsewhere.search(" /srv/other/x")


def test_the_docs_index_lists_every_data_file_once():
    """docs/README.md's data files: each JSON result under docs/ linked exactly once (a measured figure
    whose file is missing from the index, or listed twice, reads as a different result)."""
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    counts = {f.name: len(re.findall(rf"\]\({re.escape(f.name)}\)", index)) for f in (REPO / "docs").glob("*.json")}
    assert counts and {name: n for name, n in counts.items() if n != 1} == {}


DOC_NAMED = re.compile(r"(?<![\w/.-])docs/[\w.-]+\.md")


def test_every_page_the_code_and_scripts_name_exists():
    """A comment or message naming docs/<page>.md sends its reader to that page: it must be in the project
    (scripts/build_interfaces.sh named docs/ros2-from-pip.md, which never was)."""
    files = sorted({f for pattern in ("scripts/*", "launch/*", "config/*", "oxygen_ros/**/*.py", "kernels/**/*.py",
                                      "oxygen_interfaces/*.py", "setup.py") for f in REPO.glob(pattern) if f.is_file()})
    missing = [f"{f.relative_to(REPO)}: {page}" for f in files for page in DOC_NAMED.findall(f.read_text(encoding="utf-8"))
               if not (REPO / page).is_file()]
    assert not missing, "pages named but not in the project:\n" + "\n".join(missing)
