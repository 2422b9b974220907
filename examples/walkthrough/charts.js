// The page's half of charts.py: draws each div.vega-chart (its Vega-Lite spec inside, as JSON)
// with vega-embed, which the page carries (vega.js, written by scripts/build_page.py): no network.
function drawCharts() {
  for (const div of document.querySelectorAll("div.vega-chart")) {
    const spec = JSON.parse(div.querySelector("script[type='application/json']").textContent);
    const target = div.appendChild(document.createElement("div"));
    vegaEmbed(target, spec, {renderer: "svg", actions: false}).catch(console.error);
  }
}

if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", drawCharts);
} else {
  drawCharts();
}
