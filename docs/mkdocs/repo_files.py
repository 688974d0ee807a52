"""mkdocs hook: README.md as the home page, and the repository files the pages link to.

The pages are written to be read on a repository host too, so they link files by their path in
the repository (``../benchmarks/results/compare.md``, ``../examples/dp_digits.py``, README's
``docs/operations.md``). This hook brings every such file into the site at its repository path
(a Markdown file becomes a page, anything else is copied as it is), with README.md as
``index.md``, and rewrites each link to where its target lands in the site. A link to nothing
is left as it is, for the strict build to refuse.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

# [text](target) and ![alt](target "title"); the target up to a space or the closing bracket
LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
# pages of the site whether or not a page links them
ALWAYS = ("CHANGELOG.md", "benchmarks/results/*.md")


def _root(config: MkDocsConfig) -> Path:
    return Path(config.docs_dir).parent


def _targets(markdown: str) -> list[str]:
    """The relative link targets of a page, code blocks left out."""
    prose = FENCE.sub("", markdown)
    return [t for _, t, _ in LINK.findall(prose) if not re.match(r"[a-z]+:|#|/", t)]


def _resolve(page_path: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return Path(posixpath.normpath(page_path.parent / path)), anchor


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = _root(config)
    known = {Path(f.abs_src_path) for f in files if f.abs_src_path}

    def add(path: Path, src_uri: str) -> File:
        new = File.generated(config, src_uri, abs_src_path=str(path))
        files.append(new)
        known.add(path)
        return new

    add(root / "README.md", "index.md")
    for path in sorted({p for pattern in ALWAYS for p in root.glob(pattern)} - known):
        add(path, path.relative_to(root).as_posix())
    todo = [f for f in files if f.is_documentation_page()]
    while todo:  # the pages' links, and the links of the pages they bring in
        page_path = Path(todo.pop().abs_src_path or "")
        for target in _targets(page_path.read_text(encoding="utf-8")):
            path, _ = _resolve(page_path, target)
            if path not in known and path.is_file() and path.is_relative_to(root):
                new = add(path, path.relative_to(root).as_posix())
                if new.is_documentation_page():
                    todo.append(new)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Each link to a file of the site, rewritten relative to where this page lands."""
    uris = {Path(f.abs_src_path): f.src_uri for f in files if f.abs_src_path}
    page_path = Path(page.file.abs_src_path or "")
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(m: re.Match[str]) -> str:
        target = m.group(2)
        if re.match(r"[a-z]+:|#|/", target):
            return m.group(0)
        path, anchor = _resolve(page_path, target)
        if path not in uris:
            return m.group(0)
        link = posixpath.relpath(uris[path], here or ".") + (f"#{anchor}" if anchor else "")
        return f"{m.group(1)}{link}{m.group(3)}"

    # code blocks keep their text: rewrite only the prose between them
    out, last = [], 0
    for block in FENCE.finditer(markdown):
        out += [LINK.sub(rewrite, markdown[last:block.start()]), block.group(0)]
        last = block.end()
    return "".join([*out, LINK.sub(rewrite, markdown[last:])])
