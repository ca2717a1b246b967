/* The public project page: draws its charts from the data embedded in the page, then polls the page's live
   JSON (/projects/<id>/live/) and updates numbers, charts and the versions table without a reload. */
"use strict";

(function () {
  const page = document.getElementById("project-page");
  const format = window.crowdtrainFormat;
  const text = format.text; // the page's #project-text, in the page's language (charts.js reads it)
  let live = JSON.parse(document.getElementById("project-live-data").textContent);
  let charts = null;

  function target() {
    return live.project.target_value;
  }

  function drawCharts() {
    charts = {
      metrics: window.crowdtrainMetricsChart("metrics-chart", live.metrics),
      seconds: window.crowdtrainCurvesChart("curve-seconds", live.curves, "seconds", target()),
      samples: window.crowdtrainCurvesChart("curve-samples", live.curves, "samples", target()),
    };
  }

  function updateCharts() {
    window.crowdtrainSetMetrics(charts.metrics, live.metrics);
    window.crowdtrainSetCurves(charts.seconds, live.curves, "seconds", target());
    window.crowdtrainSetCurves(charts.samples, live.curves, "samples", target());
  }

  function setText(id, text) {
    const element = document.getElementById(id);
    if (element && element.textContent !== text) element.textContent = text;
  }

  const lang = document.documentElement.lang || undefined;

  /* One decimal, with the page's decimal separator (as Django's floatformat renders the first state). */
  function oneDecimal(value) {
    return value.toLocaleString(lang, { minimumFractionDigits: 1, maximumFractionDigits: 1 });
  }

  function percent(value) {
    return value === undefined || value === null ? "—" : `${oneDecimal(value * 100)}%`;
  }

  function renderStats() {
    const progress = live.progress;
    setText("stat-samples-per-second", oneDecimal(progress.samples_per_second));
    setText("stat-volunteers", String(progress.volunteers_active));
    setText("stat-flops", format.humanFlops(progress.flops));
    setText("stat-versions", String(progress.versions));
    setText("stat-eta", progress.eta_seconds === null ? "—" : progress.eta_seconds === 0 ? text.reached : format.humanSeconds(progress.eta_seconds));
    setText("stat-eta-note", progress.eta_reason);
    setText("comparison", live.comparison.statement);
    setText("project-status", (text.statuses || {})[live.project.status] || live.project.status);
    document.getElementById("project-status").dataset.status = live.project.status;
    document.getElementById("metrics-empty").hidden = live.metrics.length > 0;
    const baseline = live.baseline;
    setText("baseline-status", baseline ? baselineLine(baseline) : "");
  }

  function baselineLine(baseline) {
    const status = (text.baseline_statuses || {})[baseline.status] || baseline.status;
    const line = format.fill(text.baseline || "Baseline: %(status)s", { status });
    return baseline.reason ? `${line} — ${baseline.reason}` : line;
  }

  function renderCheckpoints() {
    for (const kind of ["latest", "best"]) {
      const link = document.getElementById(`download-${kind}`);
      const number = live.checkpoints[kind];
      link.hidden = number === null;
      link.querySelector(`[data-field="${kind}"]`).textContent = number === null ? "" : String(number);
    }
  }

  function cell(text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    return td;
  }

  function renderVersions() {
    const rows = live.versions.map((version) => {
      const tr = document.createElement("tr");
      tr.append(
        cell(`v${version.number}`),
        cell(version.samples.toLocaleString(lang), "num hide-narrow"),
        cell(version.train_loss === null ? "—" : version.train_loss.toLocaleString(lang, { minimumFractionDigits: 3, maximumFractionDigits: 3 }), "num"),
        cell(percent(version.metrics.test_accuracy), "num"),
        cell(new Date(version.created_at).toLocaleTimeString(lang), "hide-narrow"),
      );
      return tr;
    });
    document.getElementById("versions-body").replaceChildren(...rows);
  }

  function render() {
    renderStats();
    renderCheckpoints();
    renderVersions();
  }

  async function poll() {
    if (document.hidden) return;
    try {
      const response = await fetch(page.dataset.liveUrl, { headers: { Accept: "application/json" }, cache: "no-store" });
      if (!response.ok) return;
      live = await response.json();
      render();
      updateCharts();
      page.dataset.updatedAt = String(Date.now());
    } catch (error) {
      // A missed poll (server restarting, network blip) is retried at the next tick.
    }
  }

  render();
  drawCharts();
  window.setInterval(poll, Number(page.dataset.pollSeconds) * 1000);
})();
