// kvledger serve operator page: plain JS + SVG, no build step, no network beyond this server.
// Cumulative figures are parsed from /metrics (Prometheus text format), so they equal what a
// scrape shows; the chart and the last requests come from /dashboard/activity. With a key file,
// both (and the diff) need an operator key: typed in, or given as the page's fragment (/#key=KEY),
// which the browser never sends to the server.
"use strict";

const $ = (id) => document.getElementById(id);
$("op-key").value = new URLSearchParams(location.hash.slice(1)).get("key") || "";

function auth() {
  const key = $("op-key").value;
  return key ? { Authorization: "Bearer " + key } : {};
}

function parseMetrics(text) {
  // → [{name, labels: {k: v}, value}], comments skipped
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    if (m[3]) for (const l of m[3].matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    out.push({ name: m[1], labels, value: parseFloat(m[4]) });
  }
  return out;
}

function sum(samples, name, where = {}) {
  let s = 0;
  for (const x of samples) {
    if (x.name !== name) continue;
    if (Object.entries(where).every(([k, v]) => x.labels[k] === v)) s += x.value;
  }
  return s;
}

function groups(samples, name, label) {
  const g = {};
  for (const x of samples) if (x.name === name) g[x.labels[label]] = (g[x.labels[label]] || 0) + x.value;
  return g;
}

function show(id, value, text) {
  const el = $(id);
  el.dataset.value = String(value);
  el.textContent = text === undefined ? fmt(value) : text;
}

function fmt(n) { return Number.isInteger(n) ? n.toLocaleString("en-US") : n.toPrecision(4); }
function bytes(n) {
  const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (i ? n.toFixed(2) : String(n)) + " " + u[i];
}
function secs(s) { return s < 1 ? (s * 1000).toFixed(1) + " ms" : s.toFixed(3) + " s"; }

function cell(tr, text, cls) {
  const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; tr.appendChild(td);
}

function fillTable(id, rows) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    for (const c of r) Array.isArray(c) ? cell(tr, c[0], c[1]) : cell(tr, c);
    body.appendChild(tr);
  }
}

function renderMetrics(samples) {
  const prompt = sum(samples, "kvledger_prompt_tokens_total");
  const hit = sum(samples, "kvledger_prompt_cache_hit_tokens_total");
  show("prompt-tokens", prompt);
  show("hit-tokens", hit);
  show("hit-rate", prompt ? hit / prompt : 0, prompt ? (100 * hit / prompt).toFixed(1) + "%" : "–");
  show("requests", sum(samples, "kvledger_requests_total"));
  show("errors", sum(samples, "kvledger_errors_total"));
  const storeRows = (blocksName, bytesName, label) => {
    const b = groups(samples, blocksName, label), y = groups(samples, bytesName, label);
    return Object.keys(b).sort().map((k) => [k, fmt(b[k]), bytes(y[k] || 0)]);
  };
  fillTable("store-class", storeRows("kvledger_store_blocks", "kvledger_store_bytes", "ttl_class"));
  fillTable("store-namespace", storeRows("kvledger_store_namespace_blocks", "kvledger_store_namespace_bytes", "namespace"));
  const kinds = {};
  for (const x of samples) {
    if (x.name !== "kvledger_requests_total") continue;
    const key = x.labels.namespace + "\u0000" + x.labels.hit_kind;
    kinds[key] = [x.labels.namespace, x.labels.hit_kind];
  }
  fillTable("by-kind", Object.values(kinds).sort().map(([namespace, hit_kind]) => [
    namespace, [hit_kind, "kind-" + hit_kind],
    fmt(sum(samples, "kvledger_requests_total", { namespace, hit_kind })),
    fmt(sum(samples, "kvledger_prompt_cache_hit_tokens_total", { namespace, hit_kind })),
    fmt(sum(samples, "kvledger_prompt_cache_miss_tokens_total", { namespace, hit_kind }))]));
}

function renderActivity(a) {
  $("model").textContent = a.model + (a.no_cache ? " (cache disabled)" : "");
  fillTable("recent", a.recent.map((r) => [
    new Date(r.at * 1000).toLocaleTimeString(), r.namespace, r.endpoint, fmt(r.prompt_tokens), fmt(r.cached_tokens),
    fmt(r.completion_tokens), [r.hit_kind, "kind-" + r.hit_kind], r.ttft_s === null ? "–" : secs(r.ttft_s),
    r.finish_reason || "–"]));
  drawChart(a.series, a.bucket_s);
  renderTtft(a.ttft_by_length);
}

function renderTtft(t) {
  // p50 per prompt-length bucket (powers of two): a mean over all lengths would mix short and long prompts
  const p50 = (c) => (c.p50_s === null ? "–" : secs(c.p50_s));
  fillTable("ttft", t.buckets.map((b) => [
    fmt(b.tokens_from) + "–" + fmt(b.tokens_to), p50(b.cold), fmt(b.cold.requests), p50(b.hit), fmt(b.hit.requests)]));
  $("ttft-note").textContent = "the last " + t.window + " requests of each kind per bucket (in memory since start)";
}

function drawChart(series, bucketS) {
  const svg = $("chart"), W = 800, H = 220, pad = 28, ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const el = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e); return e;
  };
  if (!series.length) { el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#6b7280" }, "no requests yet"); return; }
  const t0 = series[0].start, t1 = series[series.length - 1].start + bucketS;
  const x = (t) => pad + (W - 2 * pad) * (t - t0) / Math.max(t1 - t0, bucketS);
  const maxSaved = Math.max(...series.map((b) => b.cached_tokens), 1);
  const bw = Math.max((W - 2 * pad) * bucketS / Math.max(t1 - t0, bucketS) - 1, 1);
  for (const b of series) {
    const h = (H - 2 * pad) * b.cached_tokens / maxSaved;
    el("rect", { x: x(b.start), y: H - pad - h, width: bw, height: h, fill: "#9ec5fe" });
  }
  const pts = series.map((b) => [x(b.start) + bw / 2, H - pad - (H - 2 * pad) * (b.prompt_tokens ? b.cached_tokens / b.prompt_tokens : 0)]);
  el("polyline", { points: pts.map((p) => p.join(",")).join(" "), fill: "none", stroke: "#d63384", "stroke-width": 2 });
  for (const p of pts) el("circle", { cx: p[0], cy: p[1], r: 2.5, fill: "#d63384" });
  el("line", { x1: pad, y1: H - pad, x2: W - pad, y2: H - pad, stroke: "#9aa0a6" });
  el("text", { x: 2, y: pad - 8, "font-size": 11, fill: "#6b7280" }, fmt(maxSaved) + " tok");
  el("text", { x: W - pad, y: pad - 8, "font-size": 11, fill: "#d63384", "text-anchor": "end" }, "100%");
  el("text", { x: pad, y: H - 8, "font-size": 11, fill: "#6b7280" }, new Date(t0 * 1000).toLocaleTimeString());
  el("text", { x: W - pad, y: H - 8, "font-size": 11, fill: "#6b7280", "text-anchor": "end" }, new Date(t1 * 1000).toLocaleTimeString());
}

const CAUSES = ["cold", "diverged", "expired", "evicted", "load_failed", "snapshot_missing", "tail"];
const CAUSE_COLORS = { cold: "#9ec5fe", diverged: "#d63384", expired: "#fd7e14", evicted: "#ffc107",
  load_failed: "#b02a37", snapshot_missing: "#6f42c1", tail: "#adb5bd" };

function renderMisses(list) {
  // one stacked bar per tenant: its miss tokens by cause, as shares of its prompt tokens
  const tenants = list.data;
  fillTable("miss-causes", tenants.map((t) => [t.namespace, fmt(t.requests), fmt(t.prompt_tokens),
    ...CAUSES.map((c) => fmt(t.miss_tokens[c] || 0))]));
  fillTable("divergences", tenants.flatMap((t) => t.top_divergences.map((s) => [t.namespace, fmt(s.position),
    fmt(s.requests), fmt(s.tokens_lost), JSON.stringify(s.ours), JSON.stringify(s.theirs),
    fmt(s.blocks_won_if_moved_to_end)])));
  const svg = $("miss-chart"), W = 800, H = 160, pad = 28, ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const el = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e); return e;
  };
  if (!tenants.length) { el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#6b7280" }, "no requests yet"); return; }
  const rowH = (H - pad) / tenants.length;
  tenants.forEach((t, i) => {
    let x = 120;
    for (const c of CAUSES) {
      const w = (W - 130) * (t.miss_tokens[c] || 0) / Math.max(t.prompt_tokens, 1);
      if (w > 0) el("rect", { x, y: pad / 2 + i * rowH + 2, width: w, height: rowH - 4, fill: CAUSE_COLORS[c],
        "data-cause": c, "data-tokens": t.miss_tokens[c] });
      x += w;
    }
    el("text", { x: 4, y: pad / 2 + (i + 0.5) * rowH + 4, "font-size": 12, fill: "#1d2330" }, t.namespace);
  });
  $("miss-legend").replaceChildren(...CAUSES.map((c) => {
    const s = document.createElement("span");
    s.innerHTML = `<span class="sw" style="background:${CAUSE_COLORS[c]}"></span>`;
    s.append(c.replace("_", " "));
    return s;
  }), " (share of each namespace's prompt tokens; the rest hit)");
}

async function refresh() {
  try {
    const [m, a, x] = await Promise.all([fetch("/metrics", { headers: auth() }),
      fetch("/dashboard/activity", { headers: auth() }), fetch("/v1/cache/misses", { headers: auth() })]);
    const bad = [m, a, x].find((r) => !r.ok);
    if (bad) {
      $("status").textContent = [401, 403].includes(bad.status) ? "this server needs an operator key (above)"
        : "error " + bad.status;
      return;
    }
    renderMetrics(parseMetrics(await m.text()));
    renderActivity(await a.json());
    renderMisses(await x.json());
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "1";
  } catch (e) {
    $("status").textContent = "cannot reach the server: " + e;
  }
}

function renderDiff(d) {
  const box = $("diff-result");
  box.replaceChildren();
  const pre = document.createElement("pre");
  const lines = [
    `B hits ${d.hit_blocks} of its ${d.blocks_b} full blocks after A (hit ${d.hit_tokens} tokens, ${d.hit_kind}).`,
    d.first_divergence === null ? "The prompts are identical." : `First differing token: ${d.first_divergence}.`,
    d.recoverable_blocks ? `${d.recoverable_blocks} more blocks would hit with the differing span moved to the end.` : "",
    ...d.reasons];
  if (d.context && d.context.a_differs !== undefined) lines.push(`A differs: ${JSON.stringify(d.context.a_differs)}`,
    `B differs: ${JSON.stringify(d.context.b_differs)}`);
  pre.textContent = lines.filter(Boolean).join("\n");
  box.appendChild(pre);
}

$("diff-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const headers = { "Content-Type": "application/json", ...auth() };
  const r = await fetch("/dashboard/diff", { method: "POST", headers,
    body: JSON.stringify({ a: $("diff-a").value, b: $("diff-b").value }) });
  const d = await r.json();
  if (!r.ok) { $("diff-result").textContent = d.error ? d.error.message : "error " + r.status; return; }
  renderDiff(d);
});

refresh();
setInterval(refresh, 2000);
