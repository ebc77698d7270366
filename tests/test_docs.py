"""The README and docs/: size, links, the generated CLI reference, and the mkdocs build.

The CLI reference (docs/cli.md) is written by `python -m linepack.docs_cli`; these
tests fail when it no longer matches the parser or a verb's real `--help`. The docs
build runs `mkdocs build --strict` (warnings are errors); mkdocs is installed by
tools/setup.sh, and its absence is a failure, not a skip.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
README_LIMIT = 12_000

# [text](target) links, not images' alt text handling beyond that; code spans are removed first
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _links(text):
    text = FENCE.sub("", text)
    text = CODE_SPAN.sub("", text)
    return LINK.findall(text)


def _anchors(path):
    """The heading ids mkdocs (Python-Markdown's toc) gives a page."""
    from markdown.extensions.toc import slugify
    text = FENCE.sub("", _read(path))
    seen, out = {}, set()
    for _, title in HEADING.findall(text):
        title = re.sub(r"`([^`]*)`", r"\1", title)
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = slugify(title, "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}_{n}")
    return out


def _env():
    from linepack import docs_cli
    env = dict(os.environ, COLUMNS=str(docs_cli.COLUMNS))
    env.pop("LINES", None)
    return env


def test_readme_is_at_most_12_kb():
    size = os.path.getsize(README)
    assert size <= README_LIMIT, f"README.md is {size} bytes (limit {README_LIMIT}): move text to docs/"


def test_readme_starts_with_the_two_commands():
    head = _read(README)[:2000]
    assert "bash tools/setup.sh && linepack demo" in head
    assert "bash tools/run-tests.sh" in head


def test_readme_links_resolve():
    """Every relative link of the README names an existing file (and heading, for docs/ pages)."""
    bad = []
    for target in _links(_read(README)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(ROOT, path))
        if not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            bad.append(f"{target}: no heading with id {anchor!r}")
    assert bad == []


def test_readme_links_every_docs_page():
    linked = {os.path.normpath(t.partition("#")[0]) for t in _links(_read(README))}
    pages = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))
    missing = [p for p in pages if os.path.join("docs", p) not in linked and p != "index.md"]
    assert missing == [], f"docs pages the README does not link: {missing}"


def test_cli_page_is_the_generated_one():
    from linepack import docs_cli
    assert _read(os.path.join(DOCS, "cli.md")) == docs_cli.render(), \
        "docs/cli.md is out of date: run python -m linepack.docs_cli"


def _verbs():
    from linepack import cli
    cli.build_parser()
    return sorted(cli.VERBS)


@pytest.mark.parametrize("verb", [None] + _verbs())
def test_cli_page_has_each_verbs_help(verb):
    """`linepack VERB --help`, run as a command, appears word for word in docs/cli.md."""
    argv = [sys.executable, "-m", "linepack"] + ([verb] if verb else []) + ["--help"]
    r = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no help text"
    page = _read(os.path.join(DOCS, "cli.md"))
    assert f"```text\n{r.stdout.rstrip()}\n```" in page, \
        f"'linepack {verb or ''} --help' differs from docs/cli.md: run python -m linepack.docs_cli"


def test_mkdocs_build_is_clean(tmp_path):
    """`mkdocs build --strict`: broken links, missing anchors, pages not in the nav fail it."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs is not installed (tools/setup.sh installs it: pip install mkdocs)")
    site = tmp_path / "site"
    # no --quiet: it raises mkdocs' log level above WARNING, and --strict then counts nothing
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "-f", os.path.join(ROOT, "mkdocs.yml"), "-d", str(site)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert (site / "index.html").exists()
    assert (site / "cli" / "index.html").exists()
