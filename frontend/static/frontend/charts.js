/* Crowdtrain charts (Chart.js, loaded before this file from /static/vendor/chart.umd.min.js): the admin's
   dashboard and project pages and the public project page (project.js) share them. Their words come from the
   page's #project-text (translated by Django, frontend/project_page.py) where it has one, else English. */
"use strict";

(function () {
  const UNITS = ["", "k", "M", "G", "T", "P", "E", "Z", "Y"];
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];
  const PLATFORM_COLOR = "#2563eb";
  const BASELINE_COLOR = "#ea580c";
  const ENGLISH = {
    model_version: "model version", accuracy: "accuracy", loss: "loss", platform: "platform (volunteers)",
    one_cpu: "one CPU (server)", target: "target", wall_time: "wall time (log scale)",
    samples_seen: "training samples seen (log scale)", days: "%(days)s d %(hours)s h", metrics: {},
  };
  const pageText = document.getElementById("project-text");
  const TEXT = { ...ENGLISH, ...(pageText ? JSON.parse(pageText.textContent) : {}) };

  /* "%(name)s" placeholders, as in Django's catalogue. */
  function fill(template, values) {
    return template.replace(/%\((\w+)\)s/g, (whole, name) => (name in values ? String(values[name]) : whole));
  }

  function metricName(name) {
    return TEXT.metrics[name] || name.replace(/_/g, " ");
  }

  function humanNumber(value, unit) {
    let scaled = value;
    let index = 0;
    while (Math.abs(scaled) >= 1000 && index < UNITS.length - 1) { scaled /= 1000; index += 1; }
    // In the page's language (a decimal comma in French), as the server's own numbers.
    const digits = Number(scaled.toPrecision(3)).toLocaleString(document.documentElement.lang || undefined);
    return `${digits} ${UNITS[index]}${unit}`.trim();
  }

  function humanFlops(value) {
    return humanNumber(value, "FLOP");
  }

  /* 1.2 s, 45 s, 3 min 20 s, 2 h 05 min (as projects/curves.py's duration). */
  function humanSeconds(seconds) {
    if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
    if (seconds < 10) return `${seconds.toFixed(1)} s`;
    if (seconds < 60) return `${Math.round(seconds)} s`;
    const total = Math.round(seconds);
    const minutes = Math.floor(total / 60);
    if (minutes < 60) return `${minutes} min ${String(total % 60).padStart(2, "0")} s`;
    const hours = Math.floor(minutes / 60);
    if (hours < 48) return `${hours} h ${String(minutes % 60).padStart(2, "0")} min`;
    return fill(TEXT.days, { days: Math.floor(hours / 24), hours: hours % 24 });
  }

  /* Short enough for an axis tick: 500 ms, 20 s, 500 s, 17 min, 2.5 h. */
  function compactSeconds(seconds) {
    if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
    if (seconds < 1000) return `${Number(seconds.toPrecision(2))} s`;
    if (seconds < 3600) return `${Number((seconds / 60).toPrecision(2))} min`;
    return `${Number((seconds / 3600).toPrecision(2))} h`;
  }

  window.crowdtrainFormat = { humanNumber, humanFlops, humanSeconds, fill, text: TEXT };

  /* A single series over time: data = {labels: [...], values: [...]}, unit = "FLOP/s". */
  window.crowdtrainLineChart = function (canvasId, data, unit) {
    return new Chart(document.getElementById(canvasId), {
      type: "line",
      data: {
        labels: data.labels,
        datasets: [{ label: unit, data: data.values, borderColor: COLORS[0], backgroundColor: "rgba(37,99,235,.15)", fill: true, tension: 0.25, pointRadius: 0 }],
      },
      options: {
        maintainAspectRatio: false,
        animation: false,
        plugins: { legend: { display: false }, tooltip: { callbacks: { label: (ctx) => `${humanFlops(ctx.parsed.y)}/s` } } },
        scales: { y: { beginAtZero: true, ticks: { callback: (v) => `${humanFlops(v)}/s` } } },
      },
    });
  };

  function metricsDatasets(points) {
    const names = [...new Set(points.map((p) => p.name))].sort();
    return names.map((name, i) => ({
      label: metricName(name),
      data: points.filter((p) => p.name === name).map((p) => ({ x: p.version, y: p.value })),
      borderColor: COLORS[i % COLORS.length],
      backgroundColor: COLORS[i % COLORS.length],
      yAxisID: name.includes("accuracy") ? "accuracy" : "other",
      tension: 0.2,
      pointRadius: 2,
    }));
  }

  /* Metrics per model version: points = [{version, name, value}, ...]; accuracies share the left axis (0..1). */
  window.crowdtrainMetricsChart = function (canvasId, points) {
    return new Chart(document.getElementById(canvasId), {
      type: "line",
      data: { datasets: metricsDatasets(points) },
      options: {
        maintainAspectRatio: false,
        animation: false,
        parsing: false,
        scales: {
          x: { type: "linear", title: { display: true, text: TEXT.model_version } },
          accuracy: { position: "left", min: 0, max: 1, title: { display: true, text: TEXT.accuracy } },
          other: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false }, title: { display: true, text: TEXT.loss } },
        },
      },
    });
  };

  window.crowdtrainSetMetrics = function (chart, points) {
    chart.data.datasets = metricsDatasets(points);
    chart.update("none");
  };

  /* The time-to-accuracy chart: the platform's and one CPU's curve of one metric against `xKey` ("seconds" or
     "samples"), on a log axis (one CPU may take seconds where the platform takes hours), plus the target. */
  function curveDatasets(curves, xKey, target) {
    const points = (series) => series.filter((p) => p[xKey] > 0).map((p) => ({ x: p[xKey], y: p.value }));
    const datasets = [
      { label: TEXT.platform, data: points(curves.platform), borderColor: PLATFORM_COLOR, backgroundColor: PLATFORM_COLOR },
      { label: TEXT.one_cpu, data: points(curves.baseline), borderColor: BASELINE_COLOR, backgroundColor: BASELINE_COLOR },
    ].map((d) => ({ ...d, tension: 0.2, pointRadius: 2, borderWidth: 2 }));
    const xs = datasets.flatMap((d) => d.data.map((p) => p.x));
    if (target !== null && xs.length) {
      const span = [Math.min(...xs), Math.max(...xs)];
      datasets.push({
        label: TEXT.target, data: span.map((x) => ({ x, y: target })), borderColor: "#16a34a", borderDash: [6, 4],
        borderWidth: 1.5, pointRadius: 0, backgroundColor: "#16a34a",
      });
    }
    return datasets;
  }

  window.crowdtrainCurvesChart = function (canvasId, curves, xKey, target) {
    const accuracy = curves.metric.includes("accuracy");
    const xTitle = xKey === "seconds" ? TEXT.wall_time : TEXT.samples_seen;
    const format = xKey === "seconds" ? humanSeconds : (v) => humanNumber(v, "");
    const tick = xKey === "seconds" ? compactSeconds : format;
    // A log axis ticks at 1, 1.5, 2, 3, ... per decade: label 1, 2 and 5 of each, or only 1 where a decade
    // is too narrow for three labels.
    const xTick = function (v) {
      const mantissa = v / 10 ** Math.floor(Math.log10(v));
      const whole = Math.round(mantissa);
      const decades = Math.max(Math.log10(this.max / this.min), 1);
      const shown = this.chart.width / decades < 180 ? [1] : [1, 2, 5];
      return Math.abs(mantissa - whole) < 1e-6 && shown.includes(whole) ? tick(v) : "";
    };
    return new Chart(document.getElementById(canvasId), {
      type: "line",
      data: { datasets: curveDatasets(curves, xKey, target) },
      options: {
        maintainAspectRatio: false,
        animation: false,
        parsing: false,
        interaction: { mode: "nearest", intersect: false },
        plugins: {
          legend: { position: "bottom", labels: { boxWidth: 14, usePointStyle: true } },
          tooltip: { callbacks: { title: (items) => (items.length ? format(items[0].parsed.x) : "") } },
        },
        scales: {
          x: { type: "logarithmic", title: { display: true, text: xTitle }, ticks: { callback: xTick, autoSkip: false, maxRotation: 0 } },
          y: { min: accuracy ? 0 : undefined, max: accuracy ? 1 : undefined, beginAtZero: !accuracy, title: { display: true, text: metricName(curves.metric) } },
        },
      },
    });
  };

  window.crowdtrainSetCurves = function (chart, curves, xKey, target) {
    chart.data.datasets = curveDatasets(curves, xKey, target);
    chart.update("none");
  };
})();
