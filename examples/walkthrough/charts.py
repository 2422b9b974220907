"""The walkthrough's interactive charts, in Altair (Vega-Lite) as the Annotated Transformer's 2022
edition draws them: hover for the numbers, pick a layer and a head.

``show(chart)`` displays a chart: in Jupyter as Altair displays it; for the built page (``make
page`` sets WALKTHROUGH_PAGE=1: scripts/build_page.py) as a ``div.vega-chart`` holding the chart's
spec, which the page draws with the Vega it carries, so that it needs no network."""

import json
import os

import altair as alt
from IPython.display import display

CLASS = "vega-chart"  # the page's charts.js draws each div of this class


FOR_THE_PAGE = os.environ.get("WALKTHROUGH_PAGE") == "1"


def show(chart):
    """Display ``chart``: as Altair does, or for the page a ``div.vega-chart`` with its spec."""
    if not FOR_THE_PAGE:
        display(chart)
        return
    as_json = json.dumps(chart.to_dict()).replace("</", "<\\/")  # safe inside <script>
    display({"text/html": f'<div class="{CLASS}"><script type="application/json">{as_json}'
                          "</script></div>",
             "text/plain": "(an interactive chart: open the page or Jupyter to see it)"},
            raw=True)


def curves(rows, x, y, series, title, x_title, y_title, log_y=False):
    """Lines of ``rows`` (dicts), one per value of ``series``, with a tooltip at every point."""
    scale = alt.Scale(type="log") if log_y else alt.Undefined
    return alt.Chart(alt.Data(values=rows), title=alt.Title(title)).mark_line(
        point=alt.OverlayMarkDef(size=12)).encode(
        x=alt.X(f"{x}:Q", title=x_title),
        y=alt.Y(f"{y}:Q", title=y_title, scale=scale),
        color=alt.Color(f"{series}:N", title=None, legend=alt.Legend(orient="bottom")),
        tooltip=[alt.Tooltip(f"{series}:N"), alt.Tooltip(f"{x}:Q", title=x_title),
                 alt.Tooltip(f"{y}:Q", title=y_title, format=".4g")],
    ).properties(width=560, height=260)


def attention(maps, query_tokens, key_tokens, title, query_name, key_name):
    """One layer's one head of ``maps`` ({(layer, head): rows of weights}, numbered from 0) as a
    heat-map, with a menu for the layer and one for the head (numbered from 1, as the notebook
    numbers them); hovering a cell names its two tokens and the weight."""
    layers = sorted({layer for layer, _ in maps})
    heads = sorted({head for _, head in maps})
    rows = [{"layer": layer + 1, "head": head + 1, "query": i, "key": j,
             query_name: query_tokens[i], key_name: key_tokens[j], "weight": float(weight)}
            for (layer, head), weights in maps.items()
            for i, row in enumerate(weights) for j, weight in enumerate(row)]
    layer = alt.param(name="layer", value=len(layers), bind=alt.binding_select(
        options=[n + 1 for n in layers], name="layer "))
    head = alt.param(name="head", value=1, bind=alt.binding_select(
        options=[n + 1 for n in heads], name="head "))

    def axis(tokens, name):  # positions on the axis, labelled with their tokens
        return alt.Axis(title=name, labelExpr=f"{json.dumps(tokens)}[datum.value]",
                        labelAngle=0 if name == query_name else -60)

    return alt.Chart(alt.Data(values=rows), title=alt.Title(title)).mark_rect().encode(
        x=alt.X("key:O", axis=axis(key_tokens, key_name)),
        y=alt.Y("query:O", axis=axis(query_tokens, query_name)),
        color=alt.Color("weight:Q", scale=alt.Scale(domain=[0, 1], scheme="viridis")),
        tooltip=[alt.Tooltip(f"{query_name}:N"), alt.Tooltip(f"{key_name}:N"),
                 alt.Tooltip("weight:Q", format=".3f"), "layer:O", "head:O"],
    ).add_params(layer, head).transform_filter(
        (alt.datum.layer == layer) & (alt.datum.head == head)
    ).properties(width=22 * len(key_tokens), height=22 * len(query_tokens))
