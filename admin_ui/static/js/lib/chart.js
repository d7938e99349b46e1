// Small SVG charts drawn by hand: vertical bars (stacked), horizontal bars and lines, with
// axes, gridlines, a legend and a hover tooltip. They redraw when their box changes size.

import { h } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";
export const COLORS = ["#4f46e5", "#14b8a6", "#f59e0b", "#e11d48", "#8b5cf6", "#0ea5e9", "#65a30d"];

function s(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== undefined && value !== null) node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child) node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

/** A round axis maximum and step for values up to `max` (whole steps for counts). */
export function niceScale(max, { ticks = 4, integer = false } = {}) {
  if (!(max > 0)) return { max: integer ? ticks : 1, step: integer ? 1 : 1 / ticks };
  const raw = max / ticks;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / magnitude;
  let step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 2.5 ? 2.5 : norm <= 5 ? 5 : 10) * magnitude;
  if (integer) step = Math.max(1, Math.ceil(step));
  return { max: step * Math.ceil(max / step), step };
}

function legend(series) {
  return h(
    "div",
    { class: "legend", "aria-hidden": "true" },
    series.map((item, i) => h("span", {}, h("i", { class: `swatch-${i}` }), item.name)),
  );
}

function paintSwatches(box, series) {
  // Colours come from the data, so they are set through the CSSOM (allowed by the CSP).
  series.forEach((item, i) => {
    const swatch = box.querySelector(`.swatch-${i}`);
    if (swatch) swatch.style.background = item.color || COLORS[i % COLORS.length];
  });
}

function tooltip() {
  const tip = h("div", { class: "chart-tip", hidden: true });
  return {
    node: tip,
    show(x, y, lines) {
      tip.replaceChildren(
        ...lines.map((line, i) => (i ? h("div", {}, line) : h("strong", {}, line))),
      );
      tip.hidden = false;
      tip.style.left = `${x}px`;
      tip.style.top = `${y}px`;
    },
    hide() {
      tip.hidden = true;
    },
  };
}

function emptyState(box, text) {
  box.replaceChildren(h("div", { class: "empty" }, h("strong", {}, "Nothing to show"), text));
}

/** Draw with `draw(box, width)` now and again whenever the box's width changes. */
function responsive(box, draw) {
  let lastWidth = 0;
  const render = () => {
    const width = Math.max(260, Math.floor(box.clientWidth));
    if (width === lastWidth) return;
    lastWidth = width;
    draw(width);
  };
  if (box._chartObserver) box._chartObserver.disconnect();
  box._chartObserver = new ResizeObserver(() => requestAnimationFrame(render));
  box._chartObserver.observe(box);
  render();
}

/** Axis tick values 0, step, 2·step … max. */
function tickValues(scale) {
  const values = [];
  for (let i = 0; i * scale.step <= scale.max + 1e-12; i += 1) values.push(i * scale.step);
  return values;
}

function yAxis(group, scale, plot, format) {
  for (const value of tickValues(scale)) {
    const y = plot.top + plot.height - (value / scale.max) * plot.height;
    group.append(
      s("line", { class: "grid-line", x1: plot.left, x2: plot.left + plot.width, y1: y, y2: y }),
      s("text", { x: plot.left - 8, y: y + 4, "text-anchor": "end" }, format(value, scale.step)),
    );
  }
}

function xLabels(group, labels, positions, plot) {
  const every = Math.max(1, Math.ceil((labels.length * 46) / plot.width));
  labels.forEach((label, i) => {
    if ((labels.length - 1 - i) % every !== 0) return; // counted from the end: the latest shows
    group.append(
      s(
        "text",
        { x: positions[i], y: plot.top + plot.height + 18, "text-anchor": "middle" },
        label,
      ),
    );
  });
}

function frame(width, height, leftLabels, title) {
  const left = Math.min(140, Math.max(36, Math.max(...leftLabels.map((t) => t.length)) * 6.6 + 14));
  const plot = { left, top: 10, width: width - left - 12, height: height - 38 };
  const svg = s("svg", {
    viewBox: `0 0 ${width} ${height}`,
    width,
    height,
    role: "img",
    "aria-label": title,
  });
  return { svg, plot };
}

function seriesColor(item, i) {
  return item.color || COLORS[i % COLORS.length];
}

/** The x axis's line along the bottom of the plot. */
function baseline(axis, plot) {
  const bottom = plot.top + plot.height;
  axis.append(s("line", { x1: plot.left, x2: plot.left + plot.width, y1: bottom, y2: bottom }));
}

/** A category's tooltip: its name, then each series' value. */
function categoryLines(category, series, i, format) {
  return [category, ...series.map((item) => `${item.name}: ${format(item.values[i])}`)];
}

/** A transparent rectangle over one category that shows `lines` at `[x, y]` while hovered. */
function hoverBand(tip, rect, [x, y], lines) {
  const hit = s("rect", { ...rect, fill: "transparent" });
  hit.addEventListener("mouseenter", () => tip.show(x, y, lines));
  hit.addEventListener("mouseleave", () => tip.hide());
  return hit;
}

/**
 * Vertical bars, stacked: {categories: [...labels], series: [{name, values, color}],
 * format(value) for tooltips, axisFormat(value) for the y axis, integer, title}.
 */
export function barChart(box, spec) {
  const {
    categories,
    series,
    format = String,
    axisFormat = format,
    integer = false,
    height = 240,
  } = spec;
  if (!categories.length) return emptyState(box, spec.emptyText || "No data in this period.");
  responsive(box, (width) => {
    const totals = categories.map((_, i) => series.reduce((sum, item) => sum + item.values[i], 0));
    const scale = niceScale(Math.max(...totals), { integer });
    const ticks = tickValues(scale).map((v) => axisFormat(v, scale.step));
    const { svg, plot } = frame(width, height, ticks, spec.title);
    const band = plot.width / categories.length;
    const barWidth = Math.max(2, Math.min(42, band * 0.66));
    const axis = s("g", { class: "axis" });
    yAxis(axis, scale, plot, axisFormat);
    const centers = categories.map((_, i) => plot.left + band * i + band / 2);
    xLabels(axis, categories, centers, plot);
    baseline(axis, plot);
    svg.append(axis);
    const tip = tooltip();
    categories.forEach((category, i) => {
      let base = plot.top + plot.height;
      const group = s("g", { class: "bar-group" });
      series.forEach((item, k) => {
        const value = item.values[i];
        const barHeight = (value / scale.max) * plot.height;
        if (barHeight <= 0) return;
        base -= barHeight;
        group.append(
          s(
            "rect",
            {
              class: "bar",
              x: centers[i] - barWidth / 2,
              y: base,
              width: barWidth,
              height: barHeight,
              rx: 2,
              fill: seriesColor(item, k),
            },
            s("title", {}, `${category} · ${item.name}: ${format(value)}`),
          ),
        );
      });
      group.append(
        hoverBand(
          tip,
          { x: plot.left + band * i, y: plot.top, width: band, height: plot.height },
          [centers[i], Math.max(plot.top, base)],
          categoryLines(category, series, i, format),
        ),
      );
      svg.append(group);
    });
    box.replaceChildren(legend(series), svg, tip.node);
    paintSwatches(box, series);
  });
}

/** Lines with points: same spec as barChart (values per category, per series). */
export function lineChart(box, spec) {
  const {
    categories,
    series,
    format = String,
    axisFormat = format,
    integer = false,
    height = 240,
  } = spec;
  if (!categories.length) return emptyState(box, spec.emptyText || "No data in this period.");
  responsive(box, (width) => {
    const peak = Math.max(...series.flatMap((item) => item.values));
    const scale = niceScale(peak, { integer });
    const ticks = tickValues(scale).map((v) => axisFormat(v, scale.step));
    const { svg, plot } = frame(width, height, ticks, spec.title);
    const step = categories.length > 1 ? plot.width / (categories.length - 1) : 0;
    const xs = categories.map((_, i) =>
      categories.length > 1 ? plot.left + step * i : plot.left + plot.width / 2,
    );
    const y = (value) => plot.top + plot.height - (value / scale.max) * plot.height;
    const axis = s("g", { class: "axis" });
    yAxis(axis, scale, plot, axisFormat);
    xLabels(axis, categories, xs, plot);
    baseline(axis, plot);
    svg.append(axis);
    const tip = tooltip();
    series.forEach((item, k) => {
      const color = seriesColor(item, k);
      const points = item.values.map((value, i) => `${xs[i]},${y(value)}`).join(" ");
      if (spec.area) {
        const floor = plot.top + plot.height;
        svg.append(
          s("polygon", {
            points: `${xs[0]},${floor} ${points} ${xs[xs.length - 1]},${floor}`,
            fill: color,
            "fill-opacity": 0.08,
          }),
        );
      }
      svg.append(
        s("polyline", {
          points,
          fill: "none",
          stroke: color,
          "stroke-width": 2,
          "stroke-linejoin": "round",
        }),
      );
      if (categories.length <= 60) {
        item.values.forEach((value, i) =>
          svg.append(
            s(
              "circle",
              { class: "dot", cx: xs[i], cy: y(value), r: 3, fill: color },
              s("title", {}, `${categories[i]} · ${item.name}: ${format(value)}`),
            ),
          ),
        );
      }
    });
    const band = categories.length > 1 ? step : plot.width;
    categories.forEach((category, i) => {
      svg.append(
        hoverBand(
          tip,
          { x: xs[i] - band / 2, y: plot.top, width: band, height: plot.height },
          [xs[i], y(Math.max(...series.map((item) => item.values[i])))],
          categoryLines(category, series, i, format),
        ),
      );
    });
    box.replaceChildren(legend(series), svg, tip.node);
    paintSwatches(box, series);
  });
}

/**
 * Horizontal stacked bars, one row per category (long names fit): same spec, plus
 * `notes[i]` appended to the row's tooltip (e.g. its cost).
 */
export function hbarChart(box, spec) {
  const {
    categories,
    series,
    format = String,
    axisFormat = format,
    integer = false,
    notes = [],
  } = spec;
  if (!categories.length) return emptyState(box, spec.emptyText || "No data in this period.");
  responsive(box, (width) => {
    const row = 30;
    const height = categories.length * row + 34;
    const totals = categories.map((_, i) => series.reduce((sum, item) => sum + item.values[i], 0));
    const scale = niceScale(Math.max(...totals), { integer });
    const labels = categories.map((c) => (c.length > 26 ? `${c.slice(0, 25)}…` : c));
    const { svg, plot } = frame(width, height, labels, spec.title);
    plot.height = categories.length * row;
    const x = (value) => plot.left + (value / scale.max) * plot.width;
    const axis = s("g", { class: "axis" });
    for (const value of tickValues(scale)) {
      axis.append(
        s("line", {
          class: "grid-line",
          x1: x(value),
          x2: x(value),
          y1: plot.top,
          y2: plot.top + plot.height,
        }),
        s(
          "text",
          { x: x(value), y: plot.top + plot.height + 18, "text-anchor": "middle" },
          axisFormat(value, scale.step),
        ),
      );
    }
    svg.append(axis);
    const tip = tooltip();
    categories.forEach((category, i) => {
      const top = plot.top + i * row + 6;
      svg.append(
        s(
          "text",
          { x: plot.left - 8, y: top + 13, "text-anchor": "end" },
          labels[i],
          s("title", {}, category),
        ),
      );
      let start = plot.left;
      series.forEach((item, k) => {
        const w = (item.values[i] / scale.max) * plot.width;
        if (w <= 0) return;
        svg.append(
          s(
            "rect",
            {
              class: "bar",
              x: start,
              y: top,
              width: w,
              height: row - 12,
              rx: 2,
              fill: seriesColor(item, k),
            },
            s("title", {}, `${category} · ${item.name}: ${format(item.values[i])}`),
          ),
        );
        start += w;
      });
      const lines = categoryLines(category, series, i, format);
      if (notes[i]) lines.push(notes[i]);
      svg.append(
        hoverBand(
          tip,
          { x: 0, y: top - 6, width, height: row },
          [Math.min(start, width - 90), top],
          lines,
        ),
      );
    });
    box.replaceChildren(legend(series), svg, tip.node);
    paintSwatches(box, series);
  });
}
