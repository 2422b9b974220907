#!/usr/bin/env python
"""The walkthrough as a web page (``make page``): executed from the current code, every printed
line, figure and chart in place, with the README, docs/ and the examples beside it, searchable,
readable with no network.

execute examples/walkthrough/walkthrough.py (jupytext + nbclient, as its test does; its charts
for the page: WALKTHROUGH_PAGE=1) -> a first cell saying what built it -> stage the pages with
the repository's layout, and Vega's JavaScript (vl-convert-python's bundle) -> MkDocs Material
with mkdocs-jupyter (docs/mkdocs.yml) -> SITE_DIR/walkthrough.html.

  scripts/build_page.py [--site-dir site] [--work-dir build/page]
  WALKTHROUGH_FULL=1 scripts/build_page.py      # from the walkthrough's full run
"""

import argparse
import contextlib
import datetime
import glob
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WALKTHROUGH = os.path.join(REPO, "examples", "walkthrough")
CONFIG = os.path.join(REPO, "docs", "mkdocs.yml")
# the pages of the site; the files they link to come with them
PAGES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in
                              glob.glob(os.path.join(REPO, "docs", "*.md"))
                              + glob.glob(os.path.join(REPO, "examples", "*", "README.md")))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@dataclass
class PageBuild:
    site_dir: str  # the built site
    work_dir: str  # the walkthrough's run (its figures, data, models) and the staged pages
    full: bool = False  # from WALKTHROUGH_FULL=1's run

    @property
    def run_dir(self):
        return os.path.join(self.work_dir, "run")

    @property
    def source_dir(self):
        return os.path.join(self.work_dir, "source")


@contextlib.contextmanager
def environment(**values):
    """os.environ with ``values`` set (the kernel nbclient starts inherits them)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def execute_walkthrough(run_dir, full=False, smoke_test=False):
    """The walkthrough executed in a fresh kernel, its outputs kept: (notebook, seconds).
    ``smoke_test``: its test's short Tatoeba training (WALKTHROUGH_SMOKE_TEST)."""
    import jupytext
    import nbclient

    notebook = jupytext.read(os.path.join(WALKTHROUGH, "walkthrough.py"))
    start = time.perf_counter()
    with environment(WALKTHROUGH_DIR=run_dir, WALKTHROUGH_PAGE="1",
                     WALKTHROUGH_FULL="1" if full else "0",
                     WALKTHROUGH_SMOKE_TEST="1" if smoke_test else "0"):
        nbclient.NotebookClient(notebook, timeout=3600, kernel_name="python3",
                                resources={"metadata": {"path": WALKTHROUGH}}).execute()
    return notebook, time.perf_counter() - start


def versions():
    found = {}
    for package in ("torch", "fairseq-fixed", "fairseq"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[package] = importlib.metadata.version(package)
    return ", ".join(f"{name} {version}" for name, version in found.items())


def processor():
    """The CPU's model name and core count, and a GPU where torch sees one."""
    import torch

    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        name = next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), name)
    cpu = f"the CPU ({name}, {os.cpu_count()} cores)"
    if torch.cuda.is_available():
        return f"{cpu}; a GPU was present ({torch.cuda.get_device_name()}), unused: " \
               "the walkthrough trains with --cpu"
    return cpu


def commit():
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    return None


def stamp(notebook, seconds, full, smoke_test=False):
    """Put a cell under the title saying what built the page: versions, machine, minutes."""
    import nbformat

    run = ("its full run (WALKTHROUGH_FULL=1)" if full else
           "the test suite's short run (its Tatoeba model trains 60 updates and decodes at most "
           "30 tokens)" if smoke_test else
           "its default run (`WALKTHROUGH_FULL=1 make page` builds from the full one)")
    made = commit()
    text = (f"*This page was built by `make page` on {datetime.date.today():%Y-%m-%d}"
            f"{f' from commit {made}' if made else ''}: Python {platform.python_version()}, "
            f"{versions()}, on {processor()}. Every output below is from one run of the "
            f"walkthrough, {seconds / 60:.1f} minutes long: {run}.*")
    notebook.cells.insert(1, nbformat.v4.new_markdown_cell(text))
    return notebook


def read(page):
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


def in_repository(page, target):
    """The repository path a relative link of ``page`` points to, or None."""
    path = target.partition("#")[0]
    if not path or re.match(r"[a-z]+:", path):
        return None
    return os.path.normpath(os.path.join(os.path.dirname(page), path))


def linked_files(page):
    """The files of this repository that ``page`` (a path under REPO) links to."""
    for target in LINK.findall(re.sub(r"^```.*?^```", "", read(page), flags=re.S | re.M)):
        found = in_repository(page, target)
        if found and os.path.isfile(os.path.join(REPO, found)):
            yield found


def repository_url():
    """Where GitHub Actions shows this commit's files (its variables), or None elsewhere."""
    names = ("GITHUB_SERVER_URL", "GITHUB_REPOSITORY", "GITHUB_SHA")
    if all(os.environ.get(name) for name in names):
        return "{}/{}/tree/{}".format(*(os.environ[name] for name in names))
    return None


def with_folder_links(page, url):
    """``page``'s text, its links to folders and to hidden files (which a site does not serve)
    pointing at ``url``'s copy of them, where the build knows one."""
    def replace(match):
        found = in_repository(page, match[2])
        if url and found and (os.path.isdir(os.path.join(REPO, found))
                              or any(part.startswith(".") for part in found.split(os.sep))):
            return f"{match[1]}({url}/{found})"
        return match[0]

    return re.sub(r"(!?\[[^\]]*\])\(([^)\s]+)\)", replace, read(page))


def stage(build, notebook):
    """The site's sources in build.source_dir, with the repository's layout (so every relative
    link of the README and docs/ holds): the pages, what they link to, the executed walkthrough,
    charts.js and Vega's JavaScript."""
    import nbformat
    import vl_convert

    shutil.rmtree(build.source_dir, ignore_errors=True)
    todo, copied = list(PAGES), set()
    while todo:
        page = todo.pop()
        if page in copied:
            continue
        copied.add(page)
        os.makedirs(os.path.join(build.source_dir, os.path.dirname(page)), exist_ok=True)
        if page.endswith(".md"):
            with open(os.path.join(build.source_dir, page), "w", encoding="utf-8") as f:
                f.write(with_folder_links(page, repository_url()))
            todo.extend(linked_files(page))
        else:
            shutil.copyfile(os.path.join(REPO, page), os.path.join(build.source_dir, page))
    nbformat.write(notebook, os.path.join(build.source_dir, "walkthrough.ipynb"))
    assets = os.path.join(build.source_dir, "assets")
    os.makedirs(assets)
    shutil.copyfile(os.path.join(WALKTHROUGH, "charts.js"), os.path.join(assets, "charts.js"))
    with open(os.path.join(assets, "vega.js"), "w", encoding="utf-8") as f:
        f.write(vl_convert.javascript_bundle())


def build_site(build):
    """MkDocs with docs/mkdocs.yml, from the staged sources into build.site_dir."""
    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config

    mkdocs_build(load_config(CONFIG, docs_dir=os.path.abspath(build.source_dir),
                             site_dir=os.path.abspath(build.site_dir)))


def build_page(build, notebook=None, seconds=None, smoke_test=False):
    """The whole page: the walkthrough executed (unless an executed ``notebook`` and the
    ``seconds`` it took are given), stamped, staged and built. Returns the page's path."""
    if notebook is None:
        shutil.rmtree(build.run_dir, ignore_errors=True)
        os.makedirs(build.run_dir)
        notebook, seconds = execute_walkthrough(build.run_dir, build.full, smoke_test)
    stage(build, stamp(notebook, seconds, build.full, smoke_test))
    build_site(build)
    return os.path.join(build.site_dir, "walkthrough.html")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--site-dir", default=os.path.join(REPO, "site"))
    p.add_argument("--work-dir", default=os.path.join(REPO, "build", "page"))
    args = p.parse_args()
    start = time.perf_counter()
    page = build_page(PageBuild(args.site_dir, args.work_dir,
                                full=os.environ.get("WALKTHROUGH_FULL") == "1"))
    print(f"built {os.path.relpath(page)} in {(time.perf_counter() - start) / 60:.1f} minutes; "
          f"open it in a browser, or serve the folder: python -m http.server -d "
          f"{os.path.relpath(args.site_dir)}")


if __name__ == "__main__":
    main()
