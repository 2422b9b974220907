"""examples/walkthrough cannot rot: it runs top to bottom (its checks are asserts), draws its
figures and charts, and its .ipynb is its .py (jupytext's pairing), without outputs. Its web page
(`make page`) is built from that same run and read in headless Chromium: every figure decoded,
every chart drawn, the attention charts answer the mouse and their menus, no console error, no
request off the machine, every in-page link has its target."""

import copy
import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import sys
import threading
import urllib.parse
import urllib.request

import pytest

jupytext = pytest.importorskip("jupytext", reason="the test extra's jupytext")
nbclient = pytest.importorskip("nbclient", reason="the test extra's nbclient")
pytest.importorskip("altair", reason="the walkthrough's charts: the page extra's altair")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(REPO, "examples", "walkthrough")
FIGURES = ["masks.png", "positional_encoding.png", "label_smoothing.png",
           "label_smoothing_loss.png", "noam.png", "copy_task_loss.png", "tatoeba_loss.png",
           "encoder_self.png", "decoder_self.png", "decoder_source.png"]
SHOWN_AS_CHARTS = {"positional_encoding.png", "noam.png"}  # written for docs/, shown as charts
CHARTS = ["positional encoding (d_model 20)", "the Noam schedule",
          "the copy task, pre-LN and post-LN",
          "encoder self-attention", "decoder self-attention", "decoder-source attention"]
ATTENTION = CHARTS[3:]
# review copies of what the browser showed (gitignored build/)
SCREENSHOTS = os.path.join(REPO, "build", "page-screenshots")


def load_build_page():
    spec = importlib.util.spec_from_file_location(
        "build_page", os.path.join(REPO, "scripts", "build_page.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_page = load_build_page()


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
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        assert "](examples/walkthrough/figures/" in f.read()
    with open(os.path.join(REPO, "docs", "walkthrough.md"), encoding="utf-8") as f:
        page = f.read()
    assert [name for name in FIGURES if f"figures/{name})" not in page] == []
    assert [name for name in FIGURES if not os.path.exists(os.path.join(HERE, "figures", name))] \
        == []


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """One run of the walkthrough, as `make page` runs it, with the test's short Tatoeba
    training (WALKTHROUGH_SMOKE_TEST: 60 updates, not its epoch): (notebook, seconds, its
    folder)."""
    run_dir = str(tmp_path_factory.mktemp("walkthrough"))
    notebook, seconds = build_page.execute_walkthrough(run_dir, smoke_test=True)
    return notebook, seconds, run_dir


def printed_by(notebook):
    return "\n".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code"
                     for o in c.outputs)


def chart_specs(notebook):
    """The Vega-Lite specs the walkthrough displayed for the page, in order."""
    found = re.findall(r'<div class="vega-chart"><script type="application/json">(.*?)</script>',
                       "\n".join(o.get("data", {}).get("text/html", "")
                                 for c in notebook.cells if c.cell_type == "code"
                                 for o in c.outputs), re.S)
    return [json.loads(text.replace("<\\/", "</")) for text in found]


def test_the_walkthrough_runs_top_to_bottom(executed):
    """Every cell runs without an error in a fresh kernel (its comparisons of plain and plugin
    classes are asserts), it writes every figure and shows its charts, the copy task copies,
    and the learners' questions get their numbers."""
    notebook, _, run_dir = executed
    printed = printed_by(notebook)
    assert [name for name in FIGURES if not os.path.exists(f"{run_dir}/figures/{name}")] == []
    # each cell that saves a figure also shows it inline (no non-interactive backend forced),
    # but those an interactive chart shows instead
    drawing = [c for c in notebook.cells if c.cell_type == "code"
               and re.search(r"^\s*save\(fig,", c.source, re.M)]
    assert drawing and [c.source[:60] for c in drawing
                        if not any("image/png" in o.get("data", {}) for o in c.outputs)
                        and not any(f'"{n}", shown=False' in c.source
                                    for n in SHOWN_AS_CHARTS)] == []
    assert not re.search(r"\bnan\b", printed, re.IGNORECASE), printed
    assert len(re.findall(r"max \|difference\| = ", printed)) == 7, printed
    copied = [float(x) for x in re.findall(r"beam \d: ([\d.]+)% of 500", printed)]
    assert len(copied) == 2 and min(copied) >= 99.0, printed
    # the notebook's loop learns the copy task too, and its greedy_decode on fairseq's
    # checkpoint writes what fairseq-generate --beam 1 wrote, sequence by sequence
    assert "greedy_decode copied 9 of 9 symbols" in printed, printed
    assert "fairseq-generate --beam 1 wrote for 500 of 500 test sequences" in printed, printed
    # pre-LN and post-LN each learn the copy task (post-LN trains 5 epochs here, not 10)
    nll = [(int(n), float(x)) for n, x in re.findall(r"validation NLL after (\d+) epochs "
                                                      r"([\d.]+)", printed)]
    assert [n for n, _ in nll] == [10, 5] and max(x for _, x in nll) < 0.5, printed
    # greedy and beam 5, each scored with BLEU and chrF and their signatures
    assert len(re.findall(r"^BLEU = \d+\.\d+ .*\(test, beam [15],", printed, re.M)) == 2, printed
    assert len(re.findall(r"^chrF2 = \d+\.\d+ .*\(test, beam [15],", printed, re.M)) == 2, printed
    assert len(re.findall(r"^signature: nrefs:1\|", printed, re.M)) == 4, printed
    # the cache measured at both lengths, greedy and beam 5
    assert len(re.findall(r"^\| (greedy|beam 5) \| (10|30) \| [\d.]+ \|", printed, re.M)) == 4, \
        printed
    assert [spec["title"]["text"] for spec in chart_specs(notebook)] == CHARTS


@pytest.fixture(scope="module")
def site(executed, tmp_path_factory):
    """The page built from that run, as `make page` builds it: the site's folder."""
    notebook, seconds, _ = executed
    work = tmp_path_factory.mktemp("page")
    build = build_page.PageBuild(site_dir=str(work / "site"), work_dir=str(work))
    page = build_page.build_page(build, copy.deepcopy(notebook), seconds, smoke_test=True)
    assert os.path.isfile(page)
    return build.site_dir


def chromium():
    """Debian's Chromium, or a skip (a failure under CI=true, which requires it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    missing = ("no chromium on PATH (apt-get install chromium)" if path is None else
               None if importlib.util.find_spec("playwright") else
               "no playwright (the page extra: pip install '.[page]')")
    if missing and os.environ.get("CI") == "true":
        pytest.fail(f"CI=true requires the page's browser test: {missing}")
    if missing:
        pytest.skip(f"the page's browser test: {missing}")
    return path


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # (a page closed mid-transfer)
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def served(site):
    """The site on a local HTTP server for the test's duration: its address."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=site)
    handler.log_message = lambda *args: None
    server = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    executable = chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # no background connections: this machine has no network, and would log their refusals
        yield p.chromium.launch(executable_path=executable, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])


def open_page(browser, url):
    """The page loaded, every chart drawn: (page, console errors, requests off the machine)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors, outside = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def only_this_machine(route):
        if urllib.parse.urlparse(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_this_machine)
    page.goto(url, wait_until="load")
    page.wait_for_function("document.querySelectorAll('div.vega-chart').length > 0 && "
                           "[...document.querySelectorAll('div.vega-chart')]"
                           ".every(d => d.querySelector('svg'))", timeout=30000)
    return page, errors, outside


MARKS = "g.mark-rect path, g.mark-line path, g.mark-symbol path"


def test_the_page_in_a_browser(served, browser):
    page, errors, outside = open_page(browser, f"{served}/walkthrough.html")
    os.makedirs(SCREENSHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SCREENSHOTS, "first-screen.png"))
    # the stamp: what built it
    assert "This page was built by make page" in page.locator("article").inner_text()
    # every figure decoded
    images = page.evaluate("[...document.images].map(i => [i.alt || i.src.slice(0, 40), "
                           "i.complete && i.naturalWidth > 0])")
    shown = len(FIGURES) - len(SHOWN_AS_CHARTS)
    assert sum(ok for _, ok in images) >= shown and [src for src, ok in images if not ok] == []
    # every chart drawn, each with marks, titled as the walkthrough titles them
    drawn = page.evaluate(f"""[...document.querySelectorAll('div.vega-chart')].map(d => [
        (d.querySelector('svg .role-title-text') || {{}}).textContent,
        d.querySelectorAll('{MARKS}').length])""")
    assert [title for title, _ in drawn] == CHARTS
    assert [title for title, marks in drawn if marks == 0] == []
    # in-page links have their targets; the site's own links answer
    hrefs = page.evaluate("[...document.querySelectorAll('a[href]')].map(a => "
                          "a.getAttribute('href'))")
    anchors = [h[1:] for h in hrefs if h.startswith("#") and len(h) > 1]
    assert anchors and page.evaluate(
        "ids => ids.filter(id => !document.getElementById(decodeURIComponent(id)))", anchors) == []
    local = {urllib.parse.urljoin(f"{served}/walkthrough.html", h).partition("#")[0]
             for h in hrefs if not re.match(r"[a-z]+:|#", h)}
    answers = {}
    for u in sorted(local):
        with urllib.request.urlopen(u) as response:
            answers[u] = response.status
    assert answers and [u for u, status in answers.items() if status != 200] == []
    assert errors == [] and outside == []


@pytest.mark.parametrize("title", ATTENTION)
def test_the_attention_charts_answer_the_mouse_and_their_menus(served, browser, title):
    page, errors, outside = open_page(browser, f"{served}/walkthrough.html")
    chart = page.locator("div.vega-chart").nth(CHARTS.index(title))  # (their order: above)
    chart.scroll_into_view_if_needed()
    if title == "decoder-source attention":
        page.screenshot(path=os.path.join(SCREENSHOTS, "attention.png"))
    spec = json.loads(chart.locator("script[type='application/json']").text_content())
    query_name, key_name = (t["field"] for t in spec["encoding"]["tooltip"][:2])
    tokens = {name: {row[name] for row in spec["data"]["values"]}
              for name in (query_name, key_name)}
    cells = chart.locator("g.mark-rect path")
    assert cells.count() > 1
    # hovering a cell names its two tokens and its weight
    cells.nth(cells.count() // 2).hover()
    tooltip = page.locator("#vg-tooltip-element.visible")
    tooltip.wait_for(timeout=5000)
    said = dict(zip(tooltip.locator("td.key").all_text_contents(),
                    tooltip.locator("td.value").all_text_contents()))
    assert said.get(query_name) in tokens[query_name], said
    assert said.get(key_name) in tokens[key_name], said
    assert 0.0 <= float(said["weight"]) <= 1.0, said
    # another layer, and another head, draws other weights
    menus = chart.locator(".vega-bindings select")
    assert menus.count() == 2
    for menu in (menus.nth(0), menus.nth(1)):
        before = cells.evaluate_all("cells => cells.map(c => c.getAttribute('fill'))")
        options = menu.locator("option").all_text_contents()
        chosen = menu.input_value()
        menu.select_option(next(o for o in options if o != chosen))
        page.wait_for_timeout(200)
        assert cells.evaluate_all("cells => cells.map(c => c.getAttribute('fill'))") != before
    assert errors == [] and outside == []
