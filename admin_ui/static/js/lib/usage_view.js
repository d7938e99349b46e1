// The usage view both consoles share: totals, tokens and cost per day, usage per adapter.
// `fetchReport(groupBy)` returns the API's {rows, totals} for the chosen period.

import { $, fill, h } from "./dom.js";
import { barChart, hbarChart, lineChart } from "./chart.js";
import { compactCount, count, daysBetween, microUsd, shortDay, usd, usdTick } from "./format.js";

const PROMPT = { name: "Prompt tokens", color: "#4f46e5" };
const COMPLETION = { name: "Completion tokens", color: "#14b8a6" };

function showTotals(totals) {
  fill($("#total-requests"), count(totals.requests));
  fill($("#total-prompt"), count(totals.prompt_tokens));
  fill($("#total-prompt-sub"), `${count(totals.cached_prompt_tokens)} from the prefix cache`);
  fill($("#total-completion"), count(totals.completion_tokens));
  fill($("#total-cost"), microUsd(totals.cost_micro_usd));
}

function perDay(rows, days) {
  const byDay = new Map(days.map((day) => [day, { prompt: 0, completion: 0, cost: 0 }]));
  for (const row of rows) {
    const slot = byDay.get(row.day);
    if (!slot) continue;
    slot.prompt += row.prompt_tokens;
    slot.completion += row.completion_tokens;
    slot.cost += row.cost_micro_usd;
  }
  return days.map((day) => byDay.get(day));
}

function drawDays(rows, start, end) {
  const days = daysBetween(start, end);
  const values = perDay(rows, days);
  const labels = days.map(shortDay);
  barChart($("#chart-tokens-day"), {
    title: "Tokens per day",
    categories: labels,
    series: [
      { ...PROMPT, values: values.map((v) => v.prompt) },
      { ...COMPLETION, values: values.map((v) => v.completion) },
    ],
    format: count,
    axisFormat: compactCount,
    integer: true,
  });
  lineChart($("#chart-cost-day"), {
    title: "Cost per day",
    categories: labels,
    series: [{ name: "Cost (USD)", color: "#f59e0b", values: values.map((v) => v.cost / 1e6) }],
    format: usd,
    axisFormat: usdTick,
    area: true,
  });
}

function drawAdapters(rows, tenantNames) {
  const manyTenants = new Set(rows.map((row) => row.tenant_id)).size > 1;
  const sorted = [...rows].sort(
    (a, b) => b.prompt_tokens + b.completion_tokens - (a.prompt_tokens + a.completion_tokens),
  );
  const name = (row) => {
    const adapter = row.adapter ?? "base model";
    return manyTenants
      ? `${tenantNames.get(row.tenant_id) ?? row.tenant_id} / ${adapter}`
      : adapter;
  };
  hbarChart($("#chart-adapter"), {
    title: "Tokens per adapter",
    categories: sorted.map(name),
    series: [
      { ...PROMPT, values: sorted.map((row) => row.prompt_tokens) },
      { ...COMPLETION, values: sorted.map((row) => row.completion_tokens) },
    ],
    notes: sorted.map(
      (row) => `Cost: ${microUsd(row.cost_micro_usd)} · ${count(row.requests)} requests`,
    ),
    format: count,
    axisFormat: compactCount,
    integer: true,
    emptyText: "No adapter was used in this period.",
  });
}

function showError(error) {
  for (const id of ["#chart-tokens-day", "#chart-cost-day", "#chart-adapter"]) {
    fill(
      $(id),
      h(
        "div",
        { class: "notice danger", role: "alert" },
        `Usage could not be loaded: ${error.message}`,
      ),
    );
  }
}

/** Load and draw the period `start`..`end` (UTC days, both inclusive). */
export async function showUsage({ fetchReport, start, end, tenantNames = new Map() }) {
  // tenantNames may still be on its way (a promise): only the adapter chart needs it.
  const days = fetchReport("day").then((report) => {
    showTotals(report.totals);
    drawDays(report.rows, start, end);
  });
  const adapters = Promise.all([fetchReport("adapter"), tenantNames]).then(([report, names]) =>
    drawAdapters(report.rows, names),
  );
  const results = await Promise.allSettled([days, adapters]);
  const failed = results.find((result) => result.status === "rejected");
  if (failed) showError(failed.reason);
}
