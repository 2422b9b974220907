"""The user documentation tells the truth about this repository: README.md, docs/ and the examples'
READMEs link only to what exists, name only commands, make targets and files that exist, stay
within the README's budget, keep no history (commit hashes, dates), and give each headline
figure one home."""

import glob
import importlib.metadata
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*", "README.md")))
PAGES = [README] + DOCS + EXAMPLES

# commands a bash block may start with that this repository does not provide
EXTERNAL = {"pip", "python", "python3", "python3.10", "git", "echo", "torchrun", "apt", "export",
            "cd", "mkdir", "time", ".", "srun", "trap", "wait"}
REPO_PATH = re.compile(r"^(?:scripts|examples|tests|docs|\.ci|fairseq_plugin)/[\w./-]*")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def rel(path):
    return os.path.relpath(path, ROOT)


def without_code(text):
    """The text with fenced code blocks and inline code removed (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def code_blocks(text, language):
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path):
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", read(path),
                                                          flags=re.S | re.M), flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found


def links(path):
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", without_code(read(path)))


def broken_links(path):
    broken = []
    for target in links(path):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: outside this repository
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part \
            else path
        if not os.path.exists(dest):
            broken.append(f"{target} (no such file)")
        elif anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
            broken.append(f"{target} (no heading #{anchor} in {rel(dest)})")
    return broken


@pytest.mark.parametrize("path", PAGES, ids=rel)
def test_every_relative_link_and_anchor_resolves(path):
    assert broken_links(path) == [], rel(path)


def test_every_docs_page_is_reached_from_the_readme_and_the_docs_index():
    for index in (README, os.path.join(ROOT, "docs", "README.md")):
        reached = {os.path.normpath(os.path.join(os.path.dirname(index), t.partition("#")[0]))
                   for t in links(index)}
        assert [rel(p) for p in DOCS if p not in reached and p != index] == [], rel(index)


def test_link_check_fails_on_a_missing_file_or_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title here\n[a](page.md#title-here) [b](#title-here) [c](gone.md) "
                    "[d](page.md#nowhere) `[e](inline.md)`\n```\n[f](fenced.md)\n```\n")
    assert broken_links(str(page)) == ["gone.md (no such file)",
                                       "page.md#nowhere (no heading #nowhere in "
                                       f"{rel(str(page))})"]


def makefile_targets():
    return set(re.findall(r"^([\w.-]+):", read(os.path.join(ROOT, "Makefile")), flags=re.M))


def package_commands():
    return set(re.findall(r'"(annotated-[\w-]+)=', read(os.path.join(ROOT, "setup.py"))))


def fairseq_commands():
    return {e.name for e in importlib.metadata.entry_points(group="console_scripts")
            if e.name.startswith("fairseq-")}


def shell_commands(block):
    """Each simple command of a bash block as its words (continuations joined, comments, pipes,
    && and ; split off)."""
    for line in block.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote in a placeholder: take the words before it
            words = line.split("#")[0].split()
        command = []
        for word in words + ["|"]:
            if word in ("|", "&&", ";", "||"):
                if command:
                    yield command
                command = []
            else:
                command.append(word)


def unknown_names(block, targets, commands):
    """What a bash block names that does not exist: commands, make targets, repository files
    and fairseq-hydra-train recipes."""
    unknown = []
    for words in shell_commands(block):
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before a command
            words = words[1:]
        if not words:
            continue
        name = words[0]
        if name.startswith(".venv/bin/"):
            name = name[len(".venv/bin/"):]
        if name == "make":
            unknown += [f"make {w}" for w in words[1:]
                        if "=" not in w and not w.startswith("-") and w not in targets]
        elif name == "bash":
            pass  # its script is checked as a repository path below
        elif REPO_PATH.match(name):
            pass
        elif name not in commands and name not in EXTERNAL:
            unknown.append(f"command {name}")
        for word in words[1:]:
            if REPO_PATH.match(word) and not os.path.exists(os.path.join(ROOT, word.rstrip(".,)"))):
                unknown.append(f"file {word}")
        if name == "fairseq-hydra-train" and "--config-name" in words:
            recipe = words[words.index("--config-name") + 1]
            if not os.path.exists(os.path.join(ROOT, "examples", "configs", recipe + ".yaml")):
                unknown.append(f"recipe {recipe}")
    return unknown


def inline_make_targets(text):
    return [w for code in re.findall(r"`make ([^`]+)`", text) for w in code.split()
            if "=" not in w and not w.startswith("-")]


@pytest.mark.parametrize("path", PAGES, ids=rel)
def test_every_command_make_target_and_script_in_a_bash_block_exists(path):
    targets, commands = makefile_targets(), package_commands() | fairseq_commands()
    text = read(path)
    unknown = [name for block in code_blocks(text, "bash")
               for name in unknown_names(block, targets, commands)]
    unknown += [f"make {t}" for t in inline_make_targets(text) if t not in targets]
    assert unknown == [], rel(path)


def test_command_check_fails_on_what_does_not_exist():
    block = ("make demo nosuchtarget TORCH=x\nannotated-nosuch --x \\\n  scripts/nosuch.py\n"
             "FOO=1 frobnicate | fairseq-train ok\n"
             "fairseq-hydra-train --config-dir examples/configs --config-name nosuch\n"
             "# make alsonosuch (a comment)\n")
    assert unknown_names(block, {"demo"}, {"fairseq-train", "fairseq-hydra-train"}) == [
        "make nosuchtarget", "command annotated-nosuch", "file scripts/nosuch.py",
        "command frobnicate", "recipe nosuch"]
    assert inline_make_targets("run `make demo`, then `make nosuch WORK=x`") == ["demo", "nosuch"]


def test_the_package_commands_named_in_the_docs_are_installed():
    """setup.py's console scripts are what pip installed (the check above reads setup.py)."""
    installed = {e.name for e in importlib.metadata.entry_points(group="console_scripts")}
    assert package_commands() <= installed


def test_readme_stays_within_its_budget():
    text = read(README)
    lines, words = len(text.splitlines()), len(text.split())
    assert lines <= 250, f"README.md has {lines} lines (at most 250): move detail to docs/"
    assert words <= 2000, f"README.md has {words} words (at most 2,000): move detail to docs/"


HISTORY = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b|\b20\d\d-\d\d-\d\d\b")


@pytest.mark.parametrize("path", PAGES, ids=rel)
def test_user_docs_hold_no_commit_hashes_or_dates(path):
    """The history of measurements is in git; the docs say what is true now."""
    assert HISTORY.findall(read(path)) == [], rel(path)


def results_section():
    return read(README).split("\n## Results\n", 1)[1].split("\n## ", 1)[0]


def test_history_check_finds_hashes_and_dates():
    assert HISTORY.findall("commit 9ba1a8d on 2026-11-27; d_model 512, 1e-9, cu130") == [
        "9ba1a8d", "2026-11-27"]


def test_each_headline_bleu_has_one_home():
    """The README's BLEU figures appear in no other page (the examples' pages give the rest)."""
    table = results_section().split("\n\n")[0]
    figures = set(re.findall(r"\b\d+\.\d+\b", table))
    assert len(figures) >= 5, table
    for path in DOCS + EXAMPLES:
        assert figures.isdisjoint(re.findall(r"\b\d+\.\d+\b", read(path))), rel(path)


def test_the_readmes_speed_ratios_are_those_of_the_benchmark_tables():
    """The README's speed and memory line per device summarises docs/benchmarks.md's table of
    that device: every ratio in it is there."""
    section = results_section()
    benchmarks = read(os.path.join(ROOT, "docs", "benchmarks.md"))
    for device, heading in (("2-core CPU", "## CPU"), ("NVIDIA H200", "## NVIDIA H200")):
        row = next(line for line in section.splitlines() if line.startswith(f"| {device} |"))
        ratios = re.findall(r"\d+\.\d+x", row)
        assert len(ratios) == 4, row
        table = benchmarks.split(heading, 1)[1].split("\n## ", 1)[0]
        assert [r for r in ratios if r not in table] == [], device


def test_the_development_page_has_a_line_for_every_test_file():
    page = read(os.path.join(ROOT, "docs", "development.md"))
    listed = set(re.findall(r"^\| `(test_\w+\.py)` \|", page, flags=re.M))
    files = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))}
    assert files - listed == set(), "docs/development.md lacks a line for these test files"
    assert listed - files == set(), "docs/development.md lists test files that do not exist"


def test_every_row_of_the_errors_table_names_a_test_that_exists():
    """docs/errors.md's table of bad inputs: each row's test is a test function of that file."""
    import ast

    rows = re.findall(r"^\|[^|\n]+\|[^|\n]+\| `(test_\w+\.py)::(test_\w+)` \|$",
                      read(os.path.join(ROOT, "docs", "errors.md")), re.M)
    assert len(rows) >= 25
    for file, name in rows:
        tree = ast.parse(read(os.path.join(ROOT, "tests", file)))
        tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert name in tests, f"{file}::{name}"

