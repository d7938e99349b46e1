// Operator: the live engine panel, refreshed every 2 seconds from GET /admin/engine.

import { api } from "../lib/api.js";
import { $, fill, fillRows, h } from "../lib/dom.js";
import { lineChart } from "../lib/chart.js";
import { bytes, count, ms } from "../lib/format.js";
import { startPage } from "../lib/shell.js";

const REFRESH_MS = 2000;
// The residency events, as named in the snapshot (each also as `<name>_per_min`).
const RESIDENCY = [
  "preemptions",
  "adapter_evictions",
  "adapter_reloads",
  "adapter_room_wait_steps",
];
const HISTORY = 60; // two minutes of refreshes
const history = [];
let paused = false;
let timer = null;
let refreshes = 0;
let inFlight = false;

function adapterLabel(adapter) {
  if (!adapter.adapter) return adapter.engine_name;
  return `${adapter.tenant_name} / ${adapter.adapter} v${adapter.version}`;
}

function showTier(box, tier, emptyText) {
  const summary = h(
    "div",
    { class: "row" },
    h("span", { class: "stat-value" }, count(tier.count)),
    h(
      "span",
      { class: "hint" },
      `adapters · ${bytes(tier.bytes)} of ${bytes(tier.capacity_bytes)}`,
    ),
  );
  const share = tier.capacity_bytes ? Math.min(100, (100 * tier.bytes) / tier.capacity_bytes) : 0;
  const meter = h("div", { class: "meter", "aria-hidden": "true" }, h("div", {}));
  meter.firstChild.style.width = `${share}%`;
  const chips = tier.adapters.length
    ? h(
        "ul",
        { class: "tier-list" },
        tier.adapters.map((a) =>
          h(
            "li",
            { class: "chip", title: a.pin ? `${a.engine_name}: ${a.pin}` : a.engine_name },
            adapterLabel(a),
            a.pin ? h("strong", {}, a.pin === "pinned" ? " · pinned" : " · pin pending") : "",
          ),
        ),
      )
    : h("p", { class: "hint" }, emptyText);
  fill(box, summary, meter, chips);
}

function showLatency(prefix, latency) {
  fill($(`#${prefix}-p50`), ms(latency.p50_ms));
  fill($(`#${prefix}-p90`), ms(latency.p90_ms));
  fill($(`#${prefix}-p99`), ms(latency.p99_ms));
  fill($(`#${prefix}-n`), count(latency.samples));
}

function percent(value) {
  return value === null || value === undefined ? "–" : `${(value * 100).toFixed(1)}%`;
}

// The share served over the window as a bar, with a tick where the weight's share is: while
// tenants of one priority stay backlogged, the bar should reach the tick.
function shareCell(tenant) {
  const bar = h("div", { class: "share-bar", "aria-hidden": "true" }, h("div", {}));
  bar.firstChild.style.width = `${Math.min(100, (tenant.share ?? 0) * 100)}%`;
  if (tenant.weight_share !== null && tenant.weight_share !== undefined) {
    const tick = h("span", { class: "share-target" });
    tick.style.left = `${Math.min(100, tenant.weight_share * 100)}%`;
    bar.append(tick);
  }
  const value = h("span", { class: "share-value" }, percent(tenant.share));
  return h("td", { class: "share-col" }, value, bar);
}

function showTenants(tenants, windowS) {
  const byName = [...tenants].sort((a, b) =>
    (a.tenant_name || a.tenant_id).localeCompare(b.tenant_name || b.tenant_id),
  );
  const rows = byName.map((tenant) =>
    h(
      "tr",
      { dataset: { tenantId: tenant.tenant_id } },
      h(
        "td",
        {},
        tenant.tenant_name
          ? h(
              "a",
              { href: `/ui/operator/tenants/${encodeURIComponent(tenant.tenant_id)}` },
              tenant.tenant_name,
            )
          : h("code", {}, tenant.tenant_id),
      ),
      h("td", { class: "num" }, tenant.priority ?? "–"),
      h("td", { class: "num" }, tenant.weight ?? "–"),
      h("td", { class: "num" }, percent(tenant.weight_share)),
      shareCell(tenant),
      cell(
        count(tenant.served_prompt_tokens + tenant.served_output_tokens),
        `${count(tenant.served_prompt_tokens)} prompt · ` +
          `${count(tenant.served_output_tokens)} output`,
      ),
      cell(count(tenant.queued_requests), `${count(tenant.running_requests)} running`),
    ),
  );
  fillRows(
    $("#engine-tenants tbody"),
    rows,
    "No tenants yet",
    "The engine hears each tenant's priority and weight when it is created or changed.",
  );
  fill(
    $("#share-sub"),
    "Current share: each tenant's part of the tokens served over the last " +
      `${Math.round(windowS)} s ` +
      "(output tokens count twice, as the fair-share scheduler weighs them). Weight share: its " +
      "weight over those of the tenants with requests, the share it should get while " +
      "backlogged (among tenants of one priority); the tick on each bar.",
  );
}

// Speculative decoding: the method as people read it, then per adapter what was proposed,
// accepted and gained. Off, it says how to turn it on; mixed, what each engine runs.
const SPEC_METHODS = {
  off: "Off",
  ngram: "n-gram (prompt lookup)",
  draft: "Draft model",
  mixed: "Mixed",
};

function perStep(value) {
  return value === null || value === undefined ? "–" : value.toFixed(2);
}

function specLabel(row) {
  if (row.engine_name === "") return "Base model";
  return adapterLabel(row);
}

function specFigures(figures) {
  return [
    cell(count(figures.proposed_tokens), `${count(figures.verify_steps)} verify steps`),
    cell(count(figures.accepted_tokens)),
    cell(percent(figures.acceptance_rate)),
    cell(
      perStep(figures.tokens_per_step),
      `${count(figures.generated_tokens)} tokens / ${count(figures.decode_steps)} steps`,
    ),
  ];
}

function specDetail(spec, engines) {
  if (spec.method === "off") return "";
  if (spec.method !== "mixed") {
    const k = spec.num_speculative_tokens;
    return `k = ${k}: up to ${k} proposed tokens verified per request and step`;
  }
  const each = engines
    .filter((row) => row.speculative_method)
    .map((row) =>
      row.speculative_method === "off"
        ? `${row.engine_id} off`
        : `${row.engine_id} ${row.speculative_method} (k = ${row.num_speculative_tokens})`,
    );
  return `the engines differ: ${each.join(", ")}`;
}

function showSpeculation(spec, engines) {
  const off = spec.method === "off";
  fill($("#spec-method"), SPEC_METHODS[spec.method] || spec.method);
  fill($("#spec-detail"), specDetail(spec, engines));
  const note = $("#spec-off");
  note.hidden = !off;
  if (off) {
    fill(
      note,
      "off — set ",
      h("code", {}, "LORAMUX_ENGINE_SPECULATIVE_METHOD=ngram"),
      " to have each request's own text propose its next tokens (prompt lookup, no extra " +
        "model); the output stays the same. Until then every step emits one token per request.",
    );
  }
  const rows = spec.adapters.map((row) =>
    h(
      "tr",
      { dataset: { engineName: row.engine_name } },
      h("th", { scope: "row", title: row.engine_name || null }, specLabel(row)),
      specFigures(row),
    ),
  );
  fillRows(
    $("#spec-table tbody"),
    rows,
    "No tokens generated yet",
    "Each adapter's figures appear with its first request.",
  );
  fill($("#spec-total"), h("th", { scope: "row" }, "All adapters"), specFigures(spec.total));
}

function engineStatus(row) {
  const badge =
    row.status === "up"
      ? h("span", { class: "badge ok" }, "up")
      : h("span", { class: "badge danger" }, row.status);
  const beat =
    row.heartbeat_age_s === null ? "in process" : `beat ${row.heartbeat_age_s.toFixed(1)} s ago`;
  return [badge, h("div", { class: "hint" }, row.error || beat)];
}

function rate(value) {
  if (value === null || value === undefined) return "–";
  return value.toLocaleString("en-US", { maximumFractionDigits: 1 });
}

function showMemory(memory) {
  if (!memory) {
    fill($("#memory-budget"), "–");
    fill($("#memory-source"), "not reported (an engine older than the memory figures)");
    return;
  }
  fill($("#memory-budget"), bytes(memory.budget_bytes));
  fill(
    $("#memory-source"),
    memory.source === "set" ? "set by LORAMUX_ENGINE_KV_CACHE_BYTES" : memory.detail,
  );
  fill($("#memory-kv"), `${count(memory.kv_blocks)} blocks · ${count(memory.kv_tokens)} tokens`);
  fill($("#memory-rank-label"), `One rank-${memory.rank} adapter`);
  fill($("#memory-rank"), bytes(memory.rank_adapter_bytes));
  fill(
    $("#memory-batch-label"),
    `Rank-${memory.rank} adapters beside a full batch (` +
      `${count(memory.full_batch_requests)} requests × ` +
      `${count(memory.full_batch_context)} tokens)`,
  );
  fill(
    $("#memory-beside"),
    memory.full_batch_fits ? count(memory.adapters_beside_full_batch) : "none: it does not fit",
  );
  fill($("#memory-max"), count(memory.adapters_max));
  // An engine from before the plan reported its context limit sends 0.
  fill(
    $("#memory-context"),
    memory.max_model_len
      ? `${count(memory.max_model_len)} tokens · ${count(memory.kv_floor_blocks)} blocks`
      : "–",
  );
}

// The compiled-grammar cache: host RAM, beside the device budget (its own budget and a
// share per tenant; least recently used grammars go).
function showGrammarCache(cache) {
  const box = $("#memory-grammars");
  if (!cache) {
    fill(box, "–");
    return;
  }
  fill(
    box,
    `${bytes(cache.bytes)} of ${bytes(cache.budget_bytes)}`,
    h(
      "div",
      { class: "hint" },
      `${count(cache.entries)} cached · at most ${bytes(cache.tenant_budget_bytes)} a tenant · ` +
        `${count(cache.evictions)} evicted`,
    ),
  );
}

function showResidency(residency) {
  for (const name of RESIDENCY) {
    fill($(`#res-${name}-rate`), rate(residency[`${name}_per_min`]));
    fill($(`#res-${name}`), count(residency[name]));
  }
  fill(
    $("#residency-sub"),
    `Per minute over the last ${Math.round(residency.window_s)} s, and since the engines started`,
  );
  const notice = $("#thrash-notice");
  notice.hidden = !residency.thrashing;
  fill(
    notice,
    residency.thrashing
      ? `Adapters are thrashing: ${rate(residency.adapter_reloads_per_min)} re-loads a minute. ` +
          "Memory, not compute, is the limit: raise LORAMUX_ENGINE_KV_CACHE_BYTES or lower " +
          "LORAMUX_ENGINE_MAX_NUM_SEQS."
      : "",
  );
  const pressed = residency.preemptions_per_min + residency.adapter_room_wait_steps_per_min > 0;
  fill(
    $("#residency-verdict"),
    residency.thrashing
      ? ""
      : pressed
        ? "Some memory pressure in the last minute: requests were preempted or waited for " +
          "adapter room."
        : "No: in the last minute no request was preempted or waited for adapter room.",
  );
}

function memoryCell(row) {
  if (row.budget_bytes === null || row.budget_bytes === undefined) return cell("–");
  const reloads = `${rate(row.adapter_reloads_per_min)} re-loads/min`;
  return cell(bytes(row.budget_bytes), row.thrashing ? `${reloads} · thrashing` : reloads);
}

function pair(first, second, format) {
  if (first === null || first === undefined) return "–";
  return `${format(first)} / ${format(second)}`;
}

function cell(main, hint) {
  return h("td", { class: "num" }, main, hint ? h("div", { class: "hint" }, hint) : null);
}

function showEngines(engines) {
  const rows = engines.map((row) => {
    const up = row.status === "up";
    return h(
      "tr",
      { dataset: { engineId: row.engine_id } },
      h(
        "th",
        { scope: "row" },
        h("code", {}, row.engine_id),
        row.url ? h("div", { class: "hint" }, row.url) : null,
      ),
      h("td", {}, engineStatus(row)),
      cell(
        pair(row.running_requests, row.waiting_requests, count),
        `running / waiting, of ${count(row.capacity)}`,
      ),
      cell(
        up ? `${(row.kv_usage * 100).toFixed(1)}%` : "–",
        up ? `${count(row.preemptions)} preemptions` : null,
      ),
      cell(pair(row.device_adapters, row.host_adapters, count), "device / RAM"),
      memoryCell(row),
      cell(pair(row.ttft_p50_ms, row.ttft_p99_ms, ms)),
      cell(pair(row.itl_p50_ms, row.itl_p99_ms, ms)),
    );
  });
  fillRows($("#engines-table tbody"), rows, "No engine", "No engine is registered.");
  const up = engines.filter((row) => row.status === "up").length;
  fill(
    $("#engines-sub"),
    `${up} of ${engines.length} up. Each engine process on its own; the figures above add them up.`,
  );
}

function drawLoad() {
  lineChart($("#chart-load"), {
    title: "Running and waiting requests",
    categories: history.map((point) => point.time),
    series: [
      { name: "Running", color: "#4f46e5", values: history.map((point) => point.running) },
      { name: "Waiting", color: "#f59e0b", values: history.map((point) => point.waiting) },
    ],
    format: count,
    integer: true,
    height: 200,
  });
}

function show(snapshot) {
  fill($("#running"), count(snapshot.running_requests));
  fill($("#waiting"), count(snapshot.waiting_requests));
  const kv = snapshot.kv_cache;
  fill($("#kv"), `${(kv.usage * 100).toFixed(1)}%`);
  $("#kv-meter").style.width = `${Math.min(100, kv.usage * 100)}%`;
  fill(
    $("#kv-sub"),
    `${count(kv.blocks_used)} of ${count(kv.blocks_usable)} blocks ` +
      `(${count(kv.blocks_total)} in all, ${kv.block_size} tokens each)` +
      (kv.blocks_held ? `, ${count(kv.blocks_held)} held for a waiting adapter` : "") +
      `; ${count(kv.preemptions)} preemptions`,
  );
  fill($("#registered"), count(snapshot.adapters.length));
  fill(
    $("#registered-sub"),
    `${snapshot.device.count} on the device, ${snapshot.host.count} in RAM`,
  );
  showLatency("ttft", snapshot.ttft);
  showLatency("itl", snapshot.itl);
  fill($("#latency-window"), `Over the last ${Math.round(snapshot.latency_window_s / 60)} minutes`);
  showTier(
    $("#device-tier"),
    snapshot.device,
    "No adapter is on the device: the next request for one loads it.",
  );
  showTier($("#host-tier"), snapshot.host, "No adapter is held in RAM.");
  showMemory(snapshot.memory);
  showGrammarCache(snapshot.grammar_cache);
  showResidency(snapshot.residency);
  showTenants(snapshot.tenants, snapshot.share_window_s);
  showEngines(snapshot.engines);
  showSpeculation(snapshot.speculation, snapshot.engines);
  const time = new Date(snapshot.taken_at).toLocaleTimeString("en-GB");
  history.push({ time, running: snapshot.running_requests, waiting: snapshot.waiting_requests });
  if (history.length > HISTORY) history.shift();
  drawLoad();
  refreshes += 1;
  fill($("#updated-at"), `Live · updated ${time}`);
  $("#updated-at").dataset.refreshes = String(refreshes);
}

async function refresh() {
  clearTimeout(timer);
  timer = null;
  if (inFlight) return; // the refresh under way schedules the next one
  inFlight = true;
  const error = $("#engine-error");
  try {
    const snapshot = await api("/admin/engine");
    if (!paused) show(snapshot);
    error.hidden = true;
  } catch (err) {
    error.textContent = `The engine could not be read: ${err.message}`;
    error.hidden = false;
    fill($("#updated-at"), "Retrying…");
  } finally {
    inFlight = false;
  }
  schedule();
}

function schedule() {
  if (!paused && !document.hidden && timer === null) timer = setTimeout(refresh, REFRESH_MS);
}

function setPaused(value) {
  paused = value;
  const button = $("#pause");
  button.textContent = paused ? "Resume" : "Pause";
  button.setAttribute("aria-pressed", String(paused));
  $("#live-dot").classList.toggle("paused", paused);
  if (paused) {
    clearTimeout(timer);
    timer = null;
    fill($("#updated-at"), "Paused");
  } else {
    refresh();
  }
}

if (startPage("operator")) {
  refresh();
  $("#pause").addEventListener("click", () => setPaused(!paused));
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !paused) refresh();
  });
}
