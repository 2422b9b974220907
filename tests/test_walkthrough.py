"""examples/walkthrough cannot rot: it runs top to bottom (its checks are asserts), draws its
figures, and its .ipynb is its .py (jupytext's pairing), without outputs."""

import os
import re

import pytest

jupytext = pytest.importorskip("jupytext", reason="the test extra's jupytext")
nbclient = pytest.importorskip("nbclient", reason="the test extra's nbclient")

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                    "walkthrough")
FIGURES = ["masks.png", "positional_encoding.png", "label_smoothing.png",
           "label_smoothing_loss.png", "noam.png", "copy_task_loss.png", "tatoeba_loss.png",
           "encoder_self.png", "decoder_self.png", "decoder_source.png"]


def cells(path):
    return [(c.cell_type, c.source.strip()) for c in jupytext.read(path).cells]


def test_the_notebook_file_is_the_reviewed_py_file_without_outputs():
    ipynb = os.path.join(HERE, "walkthrough.ipynb")
    assert cells(ipynb) == cells(os.path.join(HERE, "walkthrough.py")), (
        "walkthrough.ipynb differs from walkthrough.py: run "
        "`jupytext --update --to ipynb examples/walkthrough/walkthrough.py`")
    notebook = jupytext.read(ipynb)
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code")


def test_the_readme_shows_a_figure_and_the_docs_link_the_rest():
    root = os.path.dirname(os.path.dirname(HERE))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        assert "](examples/walkthrough/figures/" in f.read()
    with open(os.path.join(root, "docs", "walkthrough.md"), encoding="utf-8") as f:
        page = f.read()
    assert [name for name in FIGURES if f"figures/{name})" not in page] == []
    assert [name for name in FIGURES if not os.path.exists(os.path.join(HERE, "figures", name))] \
        == []


def test_the_walkthrough_runs_top_to_bottom(tmp_path, monkeypatch):
    """Every cell runs without an error in a fresh kernel (its comparisons of plain and plugin
    classes are asserts), it writes every figure, and the copy task copies."""
    monkeypatch.setenv("WALKTHROUGH_DIR", str(tmp_path))
    # the Tatoeba model trains 60 updates, not its epoch (171 s at one thread): what is checked of
    # it here is that each cell runs and draws
    monkeypatch.setenv("WALKTHROUGH_SMOKE_TEST", "1")
    notebook = jupytext.read(os.path.join(HERE, "walkthrough.py"))
    nbclient.NotebookClient(notebook, timeout=1800, kernel_name="python3",
                            resources={"metadata": {"path": HERE}}).execute()
    printed = "\n".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code"
                        for o in c.outputs)
    assert [name for name in FIGURES if not (tmp_path / "figures" / name).exists()] == []
    # each cell that saves a figure also shows it inline (no non-interactive backend forced)
    drawing = [c for c in notebook.cells if c.cell_type == "code"
               and re.search(r"^\s*save\(fig,", c.source, re.M)]
    assert drawing and [c.source[:60] for c in drawing
                        if not any("image/png" in o.get("data", {}) for o in c.outputs)] == []
    assert not re.search(r"\bnan\b", printed, re.IGNORECASE), printed
    assert len(re.findall(r"max \|difference\| = ", printed)) == 7, printed
    copied = [float(x) for x in re.findall(r"beam \d: ([\d.]+)% of 500", printed)]
    assert len(copied) == 2 and min(copied) >= 99.0, printed
    # the notebook's loop learns the copy task too, and its greedy_decode on fairseq's
    # checkpoint writes what fairseq-generate --beam 1 wrote, sequence by sequence
    assert "greedy_decode copied 9 of 9 symbols" in printed, printed
    assert "fairseq-generate --beam 1 wrote for 500 of 500 test sequences" in printed, printed
    assert re.search(r"BLEU = \d+\.\d+", printed), printed
