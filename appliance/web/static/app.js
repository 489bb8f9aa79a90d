// The appliance's web page: status, live plots and a chat playground, over the server's own API.
// Plain JS, no build and no library (appliance/web/__init__.py says why). Every URL is relative (TLS, proxy
// prefixes); the API key lives in sessionStorage and travels only as an Authorization header.
"use strict";

const KEY_STORE = "appliance.apiKey";
const POLL_MS = 2000;
const STATUS_EVERY = 5; // /v1/status every 5th poll (10 s): it changes on a reload only
const HISTORY = 300; // samples kept per series: 10 minutes at 2 s
const $ = (id) => document.getElementById(id);

// ---------------------------------------------------------------- API calls and the key
let keyPrompt = null; // one dialog for every call that met a 401 at the same time
let keyDeclined = false;

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

function askKey(rejected) {
  if (keyPrompt) return keyPrompt;
  const dialog = $("key-dialog");
  const msg = $("key-msg");
  msg.hidden = !rejected;
  msg.textContent = rejected ? "The server refused this API key (401): check it and enter it again." : "";
  $("key-input").value = "";
  keyPrompt = new Promise((resolve) => {
    dialog.addEventListener("close", function done() {
      dialog.removeEventListener("close", done);
      keyPrompt = null;
      const key = $("key-input").value.trim();
      if (dialog.returnValue === "ok" && key) {
        sessionStorage.setItem(KEY_STORE, key);
        keyDeclined = false;
        hideBanner();
        resolve(true);
      } else {
        keyDeclined = true;
        showBanner("This server needs an API key: use the “API key” button to enter one.");
        resolve(false);
      }
    });
    dialog.showModal();
  });
  return keyPrompt;
}

// fetch with the key; a 401 asks for a key (once) and retries. Resolves to the Response (maybe still 401).
async function api(path, options) {
  for (let attempt = 0; ; attempt++) {
    const opts = Object.assign({}, options || {});
    opts.headers = authHeaders(opts.headers);
    const response = await fetch(path, opts);
    if (response.status !== 401 || attempt >= 3) return response;
    if (keyDeclined && attempt === 0 && !(options && options.interactive)) return response;
    const rejected = Boolean(sessionStorage.getItem(KEY_STORE));
    if (rejected) sessionStorage.removeItem(KEY_STORE);
    if (!(await askKey(rejected))) return response;
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    const err = body.error;
    return (err && (err.message || err)) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

function showBanner(text) {
  const banner = $("banner");
  banner.textContent = text;
  banner.hidden = false;
}
function hideBanner() {
  $("banner").hidden = true;
}

// ---------------------------------------------------------------- Prometheus text
// {name: [{labels: {..}, value}]}; only the families the page reads are kept.
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = /^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    if (m[3]) for (const l of m[3].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    (out[m[1]] = out[m[1]] || []).push({ labels, value: parseFloat(m[4]) });
  }
  return out;
}

// The value of the unlabelled series (the server's total over models), else the sum of the labelled ones.
function total(metrics, name) {
  const series = metrics[name];
  if (!series) return null;
  const bare = series.find((s) => Object.keys(s.labels).length === 0);
  return bare ? bare.value : series.reduce((a, s) => a + s.value, 0);
}

// Cumulative buckets [[le, count]] summed over labels other than le.
function buckets(metrics, name) {
  const by = new Map();
  for (const s of metrics[name + "_bucket"] || []) {
    const le = s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le);
    by.set(le, (by.get(le) || 0) + s.value);
  }
  return [...by.entries()].sort((a, b) => a[0] - b[0]);
}

// Prometheus's histogram_quantile over the difference of two cumulative bucket sets (linear within a bucket).
function quantile(q, now, before) {
  const prev = new Map(before || []);
  const diff = now.map(([le, c]) => [le, c - (prev.get(le) || 0)]);
  const count = diff.length ? diff[diff.length - 1][1] : 0;
  if (count <= 0) return null;
  const rank = q * count;
  let lower = 0;
  let below = 0;
  for (const [le, c] of diff) {
    if (c >= rank) {
      if (le === Infinity) return lower;
      return lower + ((le - lower) * (rank - below)) / Math.max(c - below, 1e-9);
    }
    lower = le;
    below = c;
  }
  return lower;
}

// ---------------------------------------------------------------- plots (canvas)
const COLORS = ["#2563eb", "#dc6803", "#12b76a"];

class Plot {
  constructor(canvas, names, unit) {
    this.canvas = canvas;
    this.names = names;
    this.unit = unit || "";
    this.series = names.map(() => []);
    this.times = [];
  }
  push(time, values) {
    this.times.push(time);
    values.forEach((v, i) => this.series[i].push(v));
    if (this.times.length > HISTORY) {
      this.times.shift();
      this.series.forEach((s) => s.shift());
    }
    // what the browser test reads: how many samples, and how many carry a positive value
    this.canvas.dataset.points = String(this.times.length);
    this.canvas.dataset.positive = String(this.series[0].filter((v) => v > 0).length);
    this.draw();
  }
  draw() {
    const c = this.canvas;
    if (!c.offsetWidth) return; // hidden tab: drawn when shown
    const ratio = window.devicePixelRatio || 1;
    const w = c.offsetWidth;
    const h = c.offsetHeight;
    if (c.width !== Math.round(w * ratio)) c.width = Math.round(w * ratio);
    if (c.height !== Math.round(h * ratio)) c.height = Math.round(h * ratio);
    const g = c.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, w, h);
    const left = 44;
    const bottom = h - 18;
    const top = 16;
    let max = 0;
    for (const s of this.series) for (const v of s) if (v != null && v > max) max = v;
    max = niceMax(max);
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = "#616e7c";
    g.strokeStyle = "#d9e2ec";
    g.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {
      const y = bottom - ((bottom - top) * i) / 4;
      g.beginPath();
      g.moveTo(left, y);
      g.lineTo(w, y);
      g.stroke();
      g.fillText(short((max * i) / 4), 2, y + 4);
    }
    // seconds shown: what has been sampled (at least a minute), up to the history's 10 minutes
    const newest = this.times.length ? this.times[this.times.length - 1] : 0;
    const oldest = this.times.length ? this.times[0] : 0;
    const span = Math.min((POLL_MS / 1000) * HISTORY, Math.max(60, newest - oldest));
    g.fillText(span >= 120 ? "-" + Math.round(span / 60) + " min" : "-" + Math.round(span) + " s", left, h - 4);
    g.fillText("now", w - 24, h - 4);
    const x = (t) => left + ((w - left) * (span - (newest - t))) / span;
    const y = (v) => bottom - ((bottom - top) * v) / max;
    this.series.forEach((s, i) => {
      g.strokeStyle = COLORS[i % COLORS.length];
      g.lineWidth = 1.6;
      g.beginPath();
      let pen = false;
      s.forEach((v, j) => {
        if (v == null) {
          pen = false;
          return;
        }
        const px = x(this.times[j]);
        const py = y(v);
        if (pen) g.lineTo(px, py);
        else g.moveTo(px, py);
        pen = true;
      });
      g.stroke();
      g.fillStyle = COLORS[i % COLORS.length];
      s.forEach((v, j) => {
        if (v != null && s[j - 1] == null && s[j + 1] == null) {
          g.fillRect(x(this.times[j]) - 2, y(v) - 2, 4, 4); // a lone sample: a dot, not an invisible line
        }
      });
    });
    let lx = left + 4;
    this.names.forEach((name, i) => {
      const last = lastValue(this.series[i]);
      const label = name + (last == null ? "" : " " + short(last) + this.unit);
      g.fillStyle = COLORS[i % COLORS.length];
      g.fillText(label, lx, 11);
      lx += g.measureText(label).width + 14;
    });
  }
}

function lastValue(s) {
  for (let i = s.length - 1; i >= 0; i--) if (s[i] != null) return s[i];
  return null;
}
function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}
function short(v) {
  if (v == null) return "–";
  if (v >= 1000) return (v / 1000).toFixed(v >= 10000 ? 0 : 1) + "k";
  if (v >= 100 || v === 0) return v.toFixed(0);
  if (v >= 10) return v.toFixed(1);
  return v.toFixed(2);
}

const plots = {
  tps: new Plot($("plot-tps"), ["tokens/s"]),
  ttft: new Plot($("plot-ttft"), ["p50", "p99"], " ms"),
  itl: new Plot($("plot-itl"), ["p50", "p99"], " ms"),
  kv: new Plot($("plot-kv"), ["used"], "%"),
  queue: new Plot($("plot-queue"), ["queued", "running"]),
};

// ---------------------------------------------------------------- status polling
let previous = null; // {time, tokens, requests, ttft, itl}
let polls = 0;
let started = null;
let down = false; // the last poll failed (its banner is hidden again when one succeeds)

function setText(id, text) {
  $(id).textContent = text;
}

function uptime(seconds) {
  const d = Math.floor(seconds / 86400);
  const h = Math.floor((seconds % 86400) / 3600);
  const m = Math.floor((seconds % 3600) / 60);
  return (d ? d + "d " : "") + (d || h ? h + "h " : "") + m + "m " + Math.floor(seconds % 60) + "s";
}

async function pollStatus() {
  const response = await api("v1/status");
  if (!response.ok) {
    if (response.status !== 401) showBanner("Status: " + (await errorText(response)));
    return false;
  }
  const body = await response.json();
  started = body.started;
  setText("s-version", body.version);
  setText("s-isa", body.cpu_isa.name);
  const rows = body.models.map((m) => {
    const tr = document.createElement("tr");
    const cells = [m.name, m.state, m.backend, m.weight_format, m.device, m.max_context];
    for (const v of cells) {
      const td = document.createElement("td");
      td.textContent = v == null || v === "" ? "–" : String(v);
      tr.appendChild(td);
    }
    if (m.error) tr.title = m.error;
    return tr;
  });
  $("models").tBodies[0].replaceChildren(...rows);
  const ready = body.models.filter((m) => m.state === "ready").length;
  const health = $("health");
  health.textContent = ready + "/" + body.models.length + " models ready";
  health.className = "pill " + (ready === body.models.length && ready ? "ok" : "bad");
  fillModels(body.models);
  return true;
}

async function pollMetrics() {
  const response = await api("metrics");
  if (!response.ok) return;
  const m = parseMetrics(await response.text());
  const now = Date.now() / 1000;
  const sample = {
    time: now,
    tokens: total(m, "appliance_generation_tokens_total"),
    requests: total(m, "appliance_request_duration_seconds_count"),
    ttft: buckets(m, "appliance_time_to_first_token_seconds"),
    itl: buckets(m, "appliance_inter_token_latency_seconds"),
  };
  const queued = total(m, "appliance_queue_depth");
  const running = total(m, "appliance_running_sequences");
  const used = total(m, "appliance_kv_cache_blocks_used");
  const blocks = total(m, "appliance_kv_cache_blocks_total");
  setText("s-queue", short(queued));
  setText("s-running", short(running));
  setText("s-kv", used == null ? "–" : used + " / " + blocks);
  if (previous) {
    const dt = Math.max(now - previous.time, 1e-3);
    const tps = Math.max(0, (sample.tokens - previous.tokens) / dt);
    const rps = Math.max(0, (sample.requests - previous.requests) / dt);
    setText("s-tps", short(tps));
    setText("s-rps", short(rps));
    const ms = (q, a, b) => {
      const v = quantile(q, a, b);
      return v == null ? null : v * 1000;
    };
    plots.tps.push(now, [tps]);
    plots.ttft.push(now, [ms(0.5, sample.ttft, previous.ttft), ms(0.99, sample.ttft, previous.ttft)]);
    plots.itl.push(now, [ms(0.5, sample.itl, previous.itl), ms(0.99, sample.itl, previous.itl)]);
    plots.kv.push(now, [blocks ? (100 * used) / blocks : null]);
    plots.queue.push(now, [queued, running]);
  }
  previous = sample;
  if (started) setText("s-uptime", uptime(now - started));
}

async function poll() {
  try {
    if (!document.hidden) {
      if (polls % STATUS_EVERY === 0 || !started) await pollStatus();
      await pollMetrics();
      polls++;
      if (down) hideBanner();
      down = false;
    }
  } catch (e) {
    down = true;
    showBanner("The server is not answering (" + e.message + "); retrying.");
  }
  setTimeout(poll, POLL_MS);
}

// ---------------------------------------------------------------- views
function route() {
  const view = (location.hash || "#status").slice(1);
  for (const name of ["status", "plots", "chat"]) {
    $("view-" + name).hidden = name !== view;
    $("tab-" + name).classList.toggle("active", name === view);
  }
  if (view === "plots") Object.values(plots).forEach((p) => p.draw());
}
window.addEventListener("hashchange", route);
window.addEventListener("resize", () => Object.values(plots).forEach((p) => p.draw()));

// ---------------------------------------------------------------- playground
const DEFAULT_SCHEMA = {
  type: "object",
  properties: { name: { type: "string" }, age: { type: "integer" } },
  required: ["name", "age"],
  additionalProperties: false,
};
const DEFAULT_TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "The current weather in a city",
      parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
    },
  },
];
let history = [];
let controller = null;

function fillModels(models) {
  const select = $("c-model");
  const chosen = select.value;
  const names = models.filter((m) => m.state === "ready").map((m) => m.name);
  if (names.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
  select.replaceChildren(
    ...names.map((n) => {
      const o = document.createElement("option");
      o.value = o.textContent = n;
      return o;
    })
  );
  if (names.includes(chosen)) select.value = chosen;
}

function bubble(role, cls) {
  const div = document.createElement("div");
  div.className = "msg " + role + (cls ? " " + cls : "");
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  div.appendChild(who);
  $("transcript").appendChild(div);
  return div;
}

function part(parent, tag, cls, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text != null) el.textContent = text;
  parent.appendChild(el);
  return el;
}

function parseJsonField(id, what) {
  try {
    return JSON.parse($(id).value);
  } catch (e) {
    throw new Error(what + " is not valid JSON: " + e.message);
  }
}

async function send(event) {
  event.preventDefault();
  const text = $("c-input").value.trim();
  if (!text || controller) return;
  const user = bubble("user");
  part(user, "div", "text", text);
  $("c-input").value = "";
  const reply = bubble("assistant");
  const details = part(reply, "details");
  part(details, "summary", null, "Reasoning");
  const reasoning = part(details, "div", "reasoning");
  details.hidden = true;
  const answer = part(reply, "div", "text");
  const stats = part(reply, "div", "stats", "…");
  reply.scrollIntoView({ block: "end" });

  const messages = [];
  const system = $("c-system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history, { role: "user", content: text });
  const body = {
    model: $("c-model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: parseFloat($("c-temp").value),
    max_tokens: parseInt($("c-max").value, 10),
  };
  controller = new AbortController();
  $("c-send").disabled = true;
  $("c-stop").disabled = false;
  const t0 = performance.now();
  let first = null;
  let usage = null;
  let content = "";
  let finish = null;
  const calls = [];
  try {
    if ($("c-json").checked) {
      body.response_format = {
        type: "json_schema",
        json_schema: { name: "answer", schema: parseJsonField("c-schema", "The JSON schema") },
      };
    }
    if ($("c-tools").checked) body.tools = parseJsonField("c-tooldefs", "The tools");
    const response = await api("v3/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
      interactive: true,
    });
    if (!response.ok) {
      const why = await errorText(response);
      throw new Error(response.status === 401 ? "The server refused the API key (401): " + why : why);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const delta = choice.delta || {};
            if (first == null && (delta.content || delta.reasoning_content || delta.tool_calls)) first = performance.now();
            if (delta.reasoning_content) {
              details.hidden = false;
              reasoning.textContent += delta.reasoning_content;
            }
            if (delta.content) {
              content += delta.content;
              answer.textContent = content;
            }
            for (const call of delta.tool_calls || []) {
              const slot = (calls[call.index || 0] = calls[call.index || 0] || { name: "", arguments: "" });
              if (call.function && call.function.name) slot.name += call.function.name;
              if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
    }
    for (const call of calls) part(reply, "pre", "tool-call", "→ " + call.name + "(" + call.arguments + ")");
    history.push({ role: "user", content: text }, { role: "assistant", content });
    const t1 = performance.now();
    const parts = [];
    if (usage) {
      parts.push(usage.prompt_tokens + " prompt + " + usage.completion_tokens + " completion tokens");
      if (first != null && usage.completion_tokens > 1 && t1 > first) {
        parts.push(((usage.completion_tokens - 1) / ((t1 - first) / 1000)).toFixed(1) + " tokens/s");
      }
    }
    if (first != null) parts.push("first token " + Math.round(first - t0) + " ms");
    if (finish) parts.push("finish: " + finish);
    stats.textContent = parts.join(" · ");
    stats.classList.add("done");
  } catch (e) {
    reply.classList.add("error");
    stats.textContent = e.name === "AbortError" ? "stopped" : e.message;
    if (e.name === "AbortError") history.push({ role: "user", content: text }, { role: "assistant", content });
  } finally {
    controller = null;
    $("c-send").disabled = false;
    $("c-stop").disabled = true;
  }
}

function setupPlayground() {
  $("c-schema").value = JSON.stringify(DEFAULT_SCHEMA, null, 2);
  $("c-tooldefs").value = JSON.stringify(DEFAULT_TOOLS, null, 2);
  $("c-json").addEventListener("change", () => ($("c-schema-box").hidden = !$("c-json").checked));
  $("c-tools").addEventListener("change", () => ($("c-tools-box").hidden = !$("c-tools").checked));
  $("chat-form").addEventListener("submit", send);
  $("c-stop").addEventListener("click", () => controller && controller.abort());
  $("c-clear").addEventListener("click", () => {
    history = [];
    $("transcript").replaceChildren();
  });
  $("c-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
}

// ---------------------------------------------------------------- start
$("key-button").addEventListener("click", async () => {
  if (await askKey(false)) {
    previous = null;
    started = null;
  }
});
setupPlayground();
route();
poll();
