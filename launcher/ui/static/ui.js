// The page of `python -m launcher ui`: plain DOM and hand-drawn SVG, no framework, no build step.
"use strict";

const token = new URLSearchParams(location.search).get("token") || "";
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
let timer = null;
let currentRun = null;

async function api(path, body) {
  const headers = {"X-Launcher-Token": token};
  const options = body === undefined ? {headers}
    : {method: "POST", headers: {...headers, "Content-Type": "application/json"}, body: JSON.stringify(body)};
  const response = await fetch(path, options);
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

function element(tag, text, attributes = {}) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}

const fixed = (value, digits) => (value === null || value === undefined ? "" : Number(value).toFixed(digits));

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const minutes = Math.round(seconds / 60);
  return minutes >= 60 ? `${Math.floor(minutes / 60)} h ${String(minutes % 60).padStart(2, "0")} min` : `${minutes} min`;
}

// -- views ------------------------------------------------------------------------------------

function show(view) {
  for (const id of ["runs-view", "run-view", "new-view"]) $(id).hidden = id !== view;
}

// A refresh that fails (the server stopped, a run folder damaged) says why at the top, and tries again.
const reporting = (refresh) => () => refresh().then(() => { $("status").textContent = ""; },
  (error) => { $("status").textContent = error.message; });

function route() {
  clearInterval(timer);
  const hash = decodeURIComponent(location.hash.slice(1));
  if (hash.startsWith("run/")) {
    currentRun = hash.slice(4);
    show("run-view");
    poll(reporting(refreshRun), 5000);
  } else if (hash === "new") {
    show("new-view");
    reporting(loadPresets)();
  } else {
    show("runs-view");
    poll(reporting(refreshRuns), 3000);
  }
}

function poll(refresh, every) {
  refresh();
  timer = setInterval(refresh, every);
}

async function refreshRuns() {
  const runs = await api("/api/runs");
  const body = $("runs").tBodies[0];
  body.replaceChildren();
  for (const run of runs) {
    const row = element("tr", null, {"data-run": run.name});
    const link = element("a", run.name, {href: `#run/${encodeURIComponent(run.name)}`});
    row.append(element("td")); row.cells[0].append(link);
    const vram = run.vram_reserved_gib ?? run.vram_allocated_gib;
    const cells = [[run.error || run.state], [run.step === null ? "" : `${run.step ?? ""} / ${run.steps ?? ""}`, true],
      [fixed(run.s_it, 2), true], [duration(run.eta_s), true], [fixed(run.loss, 4), true], [fixed(vram, 1), true],
      [fixed(run.host_rss_gib, 1), true], [run.watchdog || ""]];
    for (const [text, number] of cells) row.append(element("td", text, number ? {class: "number"} : {}));
    if (run.state === "training") row.cells[1].className = "state-training";
    body.append(row);
  }
  $("no-runs").hidden = runs.length > 0;
}

// -- a run ------------------------------------------------------------------------------------

async function refreshRun() {
  const run = await api(`/api/runs/${encodeURIComponent(currentRun)}`);
  $("run-title").textContent = run.name;
  const eta = run.eta_s ? `, ETA ${duration(run.eta_s)}` : "";
  const speed = run.s_it ? `, ${fixed(run.s_it, 2)} s/it` : "";
  $("run-state").textContent = `${run.state}, step ${run.step ?? "-"} of ${run.steps ?? "?"}${speed}${eta}` +
    (run.watchdog ? `; watchdog: ${run.watchdog}` : "");
  drawPlots(run);
  drawSamples(run);
  const log = $("log");
  const following = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;  // at the end: stay there
  log.textContent = run.log;
  if (following) log.scrollTop = log.scrollHeight;
}

function perStep(rows, key) {
  const values = new Map();
  for (const row of rows) if (row[key] !== undefined) values.set(row.step, row[key]);
  return [...values.entries()].sort((a, b) => a[0] - b[0]);
}

function drawPlots(run) {
  const marks = run.events.filter((event) => ["stall", "dud", "not_restored", "restored"].includes(event.kind));
  plot($("plot-loss"), perStep(run.rows, "loss"), "#1f5fbf", []);
  plot($("plot-s_it"), perStep(run.rows, "s_it"), "#b8500a", marks);
  plot($("plot-power_w"), run.rows.filter((row) => row.power_w !== undefined).map((row) => [row.step, row.power_w]),
    "#6a3fb5", []);
}

function plot(svg, points, colour, marks) {
  svg.replaceChildren();
  const [width, height, left, bottom, top, right] = [400, 200, 48, 20, 8, 8];
  const add = (tag, attributes, text) => {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  add("rect", {x: left, y: top, width: width - left - right, height: height - top - bottom, fill: "none", stroke: "#ccd"});
  if (points.length === 0) {
    add("text", {x: width / 2, y: height / 2, "text-anchor": "middle"}, "no rows yet");
    return;
  }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const px = (x) => left + (x - x0) / (x1 - x0) * (width - left - right);
  const py = (y) => height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom);
  const line = points.map((p) => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ");
  add("polyline", {points: line, fill: "none", stroke: colour, "stroke-width": 1.5, class: "series"});
  if (points.length === 1) add("circle", {cx: px(points[0][0]), cy: py(points[0][1]), r: 3, fill: colour});
  const label = (value) => (Math.abs(value) >= 100 ? value.toFixed(0) : value.toPrecision(3));
  add("text", {x: left - 4, y: top + 8, "text-anchor": "end"}, label(y1));
  add("text", {x: left - 4, y: height - bottom, "text-anchor": "end"}, label(y0));
  add("text", {x: left, y: height - 6}, `step ${x0}`);
  add("text", {x: width - right, y: height - 6, "text-anchor": "end"}, `step ${x1}`);
  for (const mark of marks) {
    if (mark.step === null || mark.step < x0 || mark.step > x1) continue;
    const x = px(mark.step);
    add("line", {x1: x, x2: x, y1: top, y2: height - bottom, stroke: mark.kind === "restored" ? "#0a7d32" : "#c00",
      "stroke-dasharray": "3 2"}).append(Object.assign(document.createElementNS(SVG, "title"),
      {textContent: `${mark.kind}: ${mark.reason}`}));
  }
}

function drawSamples(run) {
  const box = $("samples");
  if (run.samples.length === 0) return;
  const shown = run.samples.map((step) => step.step).join(",");
  if (box.dataset.shown === shown) return;  // the images are already there: no reload flicker
  box.dataset.shown = shown;
  box.replaceChildren();
  for (const step of [...run.samples].reverse()) {
    const part = element("div", null, {class: "samples-step"});
    part.append(element("h4", `step ${step.step}`));
    const strengths = [...new Set(step.images.map((image) => image.strength))].sort((a, b) => a - b);
    const prompts = [...new Set(step.images.map((image) => image.prompt))].sort((a, b) => a - b);
    const table = element("table");
    const head = element("tr");
    head.append(element("th", "prompt"));
    for (const strength of strengths) head.append(element("th", `strength ${strength}`));
    table.append(head);
    for (const prompt of prompts) {
      const row = element("tr");
      row.append(element("td", String(prompt)));
      for (const strength of strengths) {
        const cell = element("td");
        const image = step.images.find((item) => item.prompt === prompt && item.strength === strength);
        if (image) cell.append(element("img", null, {src: fileUrl(run.name, image.path), alt: image.path}));
        row.append(cell);
      }
      table.append(row);
    }
    part.append(table);
    box.append(part);
  }
}

const fileUrl = (run, path) => `/files/${encodeURIComponent(run)}/${path.split("/").map(encodeURIComponent).join("/")}` +
  `?token=${encodeURIComponent(token)}`;

async function act(action) {
  const message = $("action-message");
  message.className = "";
  try {
    if (action === "save" || action === "stop") {
      message.textContent = (await api(`/api/flag/${action}`, {run: currentRun})).message;
    } else {
      const started = await api(`/api/command/${action}`, {run: currentRun});
      message.textContent = `${action} started`;
      follow(started.job, $("job-output"));
    }
  } catch (error) {
    message.className = "error";
    message.textContent = error.message;
  }
}

async function follow(job, output) {
  output.hidden = false;
  const state = await api(`/api/jobs/${encodeURIComponent(job)}`);
  const end = state.done ? `\n[${state.what} exited with code ${state.exit_code}]` : "\n[running...]";
  output.textContent = `$ python ${state.command}\n${state.output}${end}`;
  if (!state.done) setTimeout(() => follow(job, output), 1000);
}

// -- a new run --------------------------------------------------------------------------------

async function loadPresets() {
  const select = $("preset");
  if (select.options.length === 0) {
    for (const name of await api("/api/presets")) select.append(element("option", name, {value: name}));
    select.value = [...select.options].some((option) => option.value === "7900xtx_512") ? "7900xtx_512" : select.value;
  }
  await describePreset();
}

async function describePreset() {
  const preset = await api(`/api/presets/${encodeURIComponent($("preset").value)}`);
  $("preset-lines").textContent = preset.error || preset.lines.join("\n");
  $("plan").hidden = true;
  $("check-error").hidden = true;
  if (preset.error) return;
  const fill = (box, labels, values) => {
    box.querySelectorAll("label").forEach((label) => label.remove());
    for (const [name, label] of Object.entries(labels)) {
      const input = name === "prompts" ? element("textarea") : element("input", null, {type: "text"});
      input.name = name;
      input.value = values[name] || "";
      const wrap = element("label", label);
      wrap.append(input);
      box.append(wrap);
    }
  };
  fill($("fields"), preset.fields, preset.values);
  fill($("places"), preset.places, {});
}

async function check(event) {
  event.preventDefault();
  const values = {};
  for (const input of $("new-form").querySelectorAll("input, textarea")) values[input.name] = input.value;
  $("check").disabled = true;
  $("check").textContent = "checking (dry run)...";
  try {
    const result = await api("/api/check", {preset: $("preset").value, values});
    $("check-error").hidden = result.ok;
    $("check-error").textContent = result.ok ? "" : result.error;
    $("plan").hidden = !result.ok;
    if (result.ok) {
      $("eta").textContent = result.eta;
      $("plan-lines").textContent = [`$ python ${result.command}`, ...result.plan, result.warnings].join("\n").trim();
      $("start").dataset.preset = result.start;
      $("start").disabled = false;
    }
  } catch (error) {
    $("check-error").hidden = false;
    $("check-error").textContent = error.message;
  } finally {
    $("check").disabled = false;
    $("check").textContent = "check";
  }
}

async function start() {
  try {
    const started = await api("/api/start", {start: $("start").dataset.preset});
    $("start").disabled = true;
    follow(started.job, $("start-output"));
  } catch (error) {
    $("check-error").hidden = false;
    $("check-error").textContent = error.message;
  }
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", () => {
  for (const action of ["save", "stop", "comfy", "report"]) $(action).addEventListener("click", () => act(action));
  $("preset").addEventListener("change", reporting(describePreset));
  $("new-form").addEventListener("submit", check);
  $("start").addEventListener("click", start);
  route();
});
