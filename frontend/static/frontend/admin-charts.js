/* Crowdtrain admin charts (Chart.js, loaded before this file from /static/vendor/chart.umd.min.js). */
"use strict";

(function () {
  const UNITS = ["", "k", "M", "G", "T", "P", "E", "Z", "Y"];
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

  function humanFlops(value) {
    let unit = 0;
    while (Math.abs(value) >= 1000 && unit < UNITS.length - 1) { value /= 1000; unit += 1; }
    return `${Number(value.toPrecision(3))} ${UNITS[unit]}FLOP`;
  }

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

  /* Metrics per model version: points = [{version, name, value}, ...]; accuracies share the left axis (0..1). */
  window.crowdtrainMetricsChart = function (canvasId, points) {
    const names = [...new Set(points.map((p) => p.name))].sort();
    const datasets = names.map((name, i) => ({
      label: name,
      data: points.filter((p) => p.name === name).map((p) => ({ x: p.version, y: p.value })),
      borderColor: COLORS[i % COLORS.length],
      backgroundColor: COLORS[i % COLORS.length],
      yAxisID: name.includes("accuracy") ? "accuracy" : "other",
      tension: 0.2,
      pointRadius: 2,
    }));
    return new Chart(document.getElementById(canvasId), {
      type: "line",
      data: { datasets },
      options: {
        maintainAspectRatio: false,
        animation: false,
        parsing: false,
        scales: {
          x: { type: "linear", title: { display: true, text: "model version" } },
          accuracy: { position: "left", min: 0, max: 1, title: { display: true, text: "accuracy" } },
          other: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false }, title: { display: true, text: "loss" } },
        },
      },
    });
  };
})();
