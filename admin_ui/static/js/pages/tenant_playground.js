// Tenant: try an adapter with a prompt and sampling knobs; the output streams in (SSE).

import { api, streamEvents } from "../lib/api.js";
import { $, fill, h } from "../lib/dom.js";
import { clearErrors, setFieldError, showApiError } from "../lib/feedback.js";
import { numberOrNull } from "../lib/forms.js";
import { count } from "../lib/format.js";
import { startPage } from "../lib/shell.js";

const form = $("#playground-form");
const scope = $("#main"); // the prompt field sits outside the form element (form= attribute)
const output = $("#output");
const generate = $("#generate");
const stop = $("#stop");
let controller = null;

async function loadModels() {
  const select = $("#model");
  try {
    const models = await api("/v1/models");
    const adapters = models.data.filter((model) => model.owned_by === "tenant");
    const base = models.data.find((model) => model.owned_by !== "tenant");
    const wanted = new URLSearchParams(window.location.search).get("adapter");
    fill(
      select,
      adapters.length
        ? h(
            "optgroup",
            { label: "Your adapters" },
            adapters.map((m) => h("option", { value: m.id, selected: m.id === wanted }, m.id)),
          )
        : null,
      base ? h("option", { value: base.id }, `Base model (${base.id})`) : null,
    );
    if (!adapters.length)
      setFieldError(
        scope,
        "model",
        "No adapter is ready yet: upload one on the Adapters page, or try the base model.",
      );
  } catch (error) {
    fill(select, h("option", { value: "" }, "Unavailable"));
    setFieldError(scope, "model", `Models could not be listed: ${error.message}`);
  }
}

function request() {
  const prompt = $("#prompt").value;
  const maxTokens = numberOrNull($("#max_tokens"));
  let ok = true;
  if (!$("#model").value) ok = !setFieldError(scope, "model", "Choose an adapter.");
  if (!prompt.trim()) ok = !setFieldError(scope, "prompt", "Write a prompt first.");
  if (maxTokens === null || Number.isNaN(maxTokens)) {
    ok = !setFieldError(scope, "max_tokens", "Enter how many tokens to generate.");
  }
  if (!ok) return null;
  const mode = $("#mode").value;
  const common = {
    model: $("#model").value,
    max_tokens: maxTokens,
    temperature: Number($("#temperature").value),
    top_p: Number($("#top_p").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  return mode === "chat"
    ? {
        path: "/v1/chat/completions",
        body: { ...common, messages: [{ role: "user", content: prompt }] },
        text: (c) => c.delta.content,
      }
    : { path: "/v1/completions", body: { ...common, prompt }, text: (c) => c.text };
}

function showMetrics({ ttft, usage, chunks, finish, seconds }) {
  const parts = [];
  if (ttft !== null) parts.push(["First token", `${Math.round(ttft)} ms`]);
  // The usage arrives at the end; until then (or when stopped) count the chunks seen.
  const out = usage ? usage.completion_tokens : chunks;
  if (usage) parts.push(["Tokens", `${count(usage.prompt_tokens)} in · ${count(out)} out`]);
  else if (chunks) parts.push(["Tokens", `${count(out)} out`]);
  if (out && seconds > 0) parts.push(["Speed", `${(out / seconds).toFixed(1)} tok/s`]);
  if (finish) parts.push(["Finish", finish]);
  fill(
    $("#run-metrics"),
    parts.map(([label, value]) => h("span", {}, `${label} `, h("b", {}, value))),
  );
}

function setRunning(running) {
  generate.disabled = running;
  stop.disabled = !running;
  output.classList.toggle("streaming", running);
  output.setAttribute("aria-busy", String(running));
}

async function run(event) {
  event.preventDefault();
  clearErrors(scope);
  $("#run-error").hidden = true;
  const call = request();
  if (!call) return;
  controller = new AbortController();
  const started = performance.now();
  const state = { ttft: null, usage: null, chunks: 0, finish: null, seconds: 0 };
  let text = "";
  fill(output, "");
  output.dataset.finished = "false";
  fill(
    $("#run-metrics"),
    h("span", { class: "row" }, h("span", { class: "spinner" }), "Waiting for the first token…"),
  );
  setRunning(true);
  try {
    await streamEvents(call.path, call.body, {
      signal: controller.signal,
      onEvent: (chunk) => {
        if (chunk.usage) state.usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        const delta = call.text(choice) || "";
        if (delta && state.ttft === null) state.ttft = performance.now() - started;
        if (delta) state.chunks += 1;
        text += delta;
        output.textContent = text;
        if (choice.finish_reason) state.finish = choice.finish_reason;
        state.seconds = (performance.now() - started - (state.ttft || 0)) / 1000;
        showMetrics(state);
      },
    });
    if (!text) fill(output, h("span", { class: "placeholder" }, "(the model returned no text)"));
  } catch (error) {
    if (error.name === "AbortError") {
      state.finish = "stopped";
    } else {
      const box = $("#run-error");
      showApiError(scope, error, { fallback: box });
    }
  } finally {
    setRunning(false);
    controller = null;
    showMetrics(state);
    output.dataset.finished = "true";
  }
}

function wireKnobs() {
  for (const name of ["temperature", "top_p"]) {
    const input = $(`#${name}`);
    input.addEventListener("input", () => fill($(`#${name}-value`), input.value));
  }
  $("#prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
  });
  stop.addEventListener("click", () => controller && controller.abort());
}

if (startPage("tenant")) {
  loadModels();
  wireKnobs();
  form.addEventListener("submit", run);
}
