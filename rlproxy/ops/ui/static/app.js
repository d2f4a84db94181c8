// The rlproxy dashboard: three pages drawn from /ui/api/*. No framework, no build step.
// Every recorded value is put into the page as text (textContent), never as HTML: agent
// content is untrusted.
"use strict";

const view = document.getElementById("view");
let timer = null;
let routed = 0;  // route() calls so far: a page fetched for an earlier one is not shown
let shown = null;  // the hash whose page the view shows

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick") node.onclick = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));  // strings become text nodes
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

async function api(path, options) {
  // the custom header marks the request as the dashboard's own (the server's CSRF check)
  const r = await fetch(path, Object.assign(
    {credentials: "same-origin", headers: {"X-RLProxy-UI": "1"}}, options || {}));
  if (r.status === 401) { location.href = "/ui/login"; throw new Error("not signed in"); }
  const body = await r.json().catch(() => null);  // e.g. a plain-text 404 or a proxy's page
  if (!r.ok || body === null) {
    throw new Error((body && body.error && body.error.message) ||
                    `${path} answered ${r.status} ${r.statusText}`);
  }
  return body;
}

const fmt = (x, d = 3) => (x === null || x === undefined) ? "–" :
  (typeof x !== "number" ? String(x) : Number.isInteger(x) ? String(x) :
   x.toFixed(d).replace(/^-(0\.?0*)$/, "$1"));  // no "-0.0"
const when = (t) => t ? new Date(t * 1000).toLocaleString() : "–";

// ---- charts: SVG drawn here ----

// Ticks at a round step (1, 2 or 5 times a power of ten) inside [lo, hi], each label once, with
// as many decimals as the step needs; on a whole axis (optimizer steps) whole numbers only.
function ticks(lo, hi, whole, count = 4) {
  const raw = (hi - lo) / count, power = 10 ** Math.floor(Math.log10(raw));
  const f = raw / power;
  let step = (f >= 7.07 ? 10 : f >= 3.16 ? 5 : f >= 1.41 ? 2 : 1) * power;
  if (whole) step = Math.max(1, Math.round(step));
  const digits = whole ? 0 : Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const values = [];
  for (let k = Math.ceil(lo / step - 1e-9); k * step <= hi + step * 1e-9; k++) {
    values.push(k * step);
  }
  return {step, values, label: x => x.toFixed(digits).replace(/^-(0\.?0*)$/, "$1")};
}

function lineChart(title, id, series, opts = {}) {
  // opts.marks: [{x, label}] drawn as dashed red vertical lines (the eval gate's rollbacks);
  // opts.empty: what the card says when there is nothing to draw (no bare axes);
  // opts.xwhole: false for a real-valued x axis; opts.xspan: [a, b] the x axis covers at least;
  // opts.ymin / ymax: fixed ends of the y axis; opts.note: a line under the title
  const w = 440, h = 200, l = 48, r = 14, t = 22, b = 36;
  const finite = p => p[1] !== null && p[1] !== undefined && isFinite(p[1]);
  const all = series.flatMap(s => s.pts).filter(finite);
  const marks = opts.marks || [];
  const head = [el("h3", {}, title), opts.note || null];
  if (!all.length && !marks.length) {
    return el("div", {class: "card"}, ...head,
              el("p", {class: "empty", id}, opts.empty || "no data yet"));
  }
  const whole = opts.xwhole ?? true;
  const xs = all.map(p => p[0]).concat(marks.map(m => m.x), opts.xspan || []);
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (x1 === x0) { x0 -= 0.5; x1 += 0.5; }  // one step: in the middle, under its own tick
  const ys = all.length ? all.map(p => p[1]) : [0];
  let y0 = opts.ymin ?? Math.min(...ys), y1 = opts.ymax ?? Math.max(...ys);
  if (y1 === y0) {  // a flat line: widen on the free side(s)
    const pad = Math.abs(y0) / 2 || 1;
    if (opts.ymin === undefined) y0 -= pad;
    if (opts.ymax === undefined || opts.ymin !== undefined) y1 += pad;
  }
  let yt = ticks(y0, y1, false);
  if (opts.ymin === undefined) y0 = Math.floor(y0 / yt.step + 1e-9) * yt.step;  // to the grid
  if (opts.ymax === undefined) y1 = Math.ceil(y1 / yt.step - 1e-9) * yt.step;
  yt = ticks(y0, y1, false);
  const X = x => l + (w - l - r) * (x - x0) / (x1 - x0);
  const Y = y => t + (h - t - b) * (1 - (y - y0) / (y1 - y0));
  const box = svg("svg", {id, width: "100%", viewBox: `0 0 ${w} ${h}`});
  for (const y of yt.values) {
    box.append(svg("line", {x1: l, x2: w - r, y1: Y(y), y2: Y(y), stroke: "#eee"}));
    const label = svg("text", {x: l - 4, y: Y(y) + 4, "text-anchor": "end", class: "ytick"});
    label.textContent = yt.label(y);
    box.append(label);
  }
  const xt = ticks(x0, x1, whole);
  for (const x of xt.values) {
    const tick = svg("text", {x: X(x), y: h - b + 16, "text-anchor": "middle", class: "xtick"});
    tick.textContent = xt.label(x);
    box.append(tick);
  }
  const xl = svg("text", {x: (l + w - r) / 2, y: h - 4, "text-anchor": "middle"});
  xl.textContent = opts.xlabel || "";
  box.append(xl);
  for (const m of marks) {
    const mark = svg("line", {x1: X(m.x), x2: X(m.x), y1: t, y2: h - b, stroke: "#d62728",
                              "stroke-dasharray": "4 3", class: "rollback"});
    const tip = svg("title", {});
    tip.textContent = m.label;  // text: the reason is recorded data
    mark.append(tip);
    box.append(mark);
  }
  let k = 0;
  for (const s of series) {
    const pts = s.pts.filter(finite);
    if (pts.length > 1 && s.line !== false) {
      box.append(svg("polyline", {points: pts.map(p => `${X(p[0])},${Y(p[1])}`).join(" "),
                                  fill: "none", stroke: s.color, "stroke-width": 1.5,
                                  class: "series", "data-name": s.name}));
    }
    if (s.dots || pts.length === 1) for (const p of pts) {  // a lone point: a dot, not nothing
      box.append(svg("circle", {cx: X(p[0]), cy: Y(p[1]), r: s.line === false ? 4 : 2.5,
                                fill: s.line === false ? "none" : s.color, stroke: s.color,
                                class: s.dots ? "pt" : "lone"}));
    }
    const key = svg("text", {x: l + 150 * k++, y: 13, fill: s.color});
    key.textContent = s.name;
    key.setAttribute("style", `fill:${s.color}`);
    box.append(key);
  }
  return el("div", {class: "card"}, ...head, box);
}

function rolling(pts, n) {
  const out = [];
  for (let i = 0; i < pts.length; i++) {
    const win = pts.slice(Math.max(0, i - n + 1), i + 1).map(p => p[1]);
    out.push([pts[i][0], win.reduce((a, b) => a + b, 0) / win.length]);
  }
  return out;
}

function counter(label, value) {
  return el("div", {class: "counter"}, el("b", {}, fmt(value, 2)), el("span", {}, label));
}

// Bytes as people read them, in powers of 1000: "512 B", "3.4 MB", "12 GB".
function bytes(n) {
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return i ? `${n.toFixed(n < 10 ? 1 : 0)} ${units[i]}` : `${n} B`;
}

// The record files' bytes on disk (they only grow), each file's and the checkpoints' on hover.
function recordsCounter(r) {
  const each = Object.entries(r.files).map(([name, n]) => `${name}: ${bytes(n)}`);
  each.push(`checkpoints: ${bytes(r.checkpoints_bytes)}`);
  return el("div", {class: "counter", id: "records-size", title: each.join("\n")},
    el("b", {}, bytes(r.bytes)), el("span", {}, "records on disk"));
}

const percent = (x) => x === null || x === undefined ? "" : ` (${Math.round(100 * x)}%)`;

// The judge's health (/healthz's scoring.judge): its verdicts as a bar, what at-least-one
// lifted, and how often it agrees with the people who gave feedback.
function judgePanel(sc) {
  const j = sc.judge;
  if (sc.verdict === null) {
    return el("div", {class: "card", id: "judge"}, el("h3", {}, "Judge (PRM)"),
      el("p", {}, "off: rewards come from reward functions and feedback"),
      el("p", {}, `${j.released} turns released to training`));
  }
  const judged = j.good + j.bad + j.undecided;
  const part = (n, cls) => el("span", {class: cls, style: `flex-grow:${n}`});
  const both = j.feedback_agree + j.feedback_disagree;
  return el("div", {class: "card", id: "judge"}, el("h3", {}, `Judge (PRM): ${sc.verdict}`),
    judged ? el("div", {class: "bar"}, part(j.good, "good"), part(j.bad, "bad"),
                part(j.undecided, "undecided")) : el("p", {class: "empty"}, "no verdicts yet"),
    el("p", {class: "verdicts"}, `${j.good} worked / ${j.bad} failed / ${j.undecided} ` +
       `undecided${percent(j.undecided_share)}, ${j.skipped} skipped (feedback or a reward ` +
       "function decided)"),
    el("p", {class: "lifted"}, `at-least-one lifted ${j.lifted} of ${j.released} released` +
       percent(j.lifted_share)),
    el("p", {class: "agreement"}, both ? `agrees with feedback ${j.feedback_agree} of ${both}`
       : "no explicit feedback on a decided verdict yet"));
}

// What the held-out chart says when it has no reward to draw.
function heldOutEmpty(evals, tr) {
  if (evals.length) return `no reward measured in ${plural(evals.length, "evaluation")}`;
  if (tr.eval_every) return `no evaluations yet (the eval gate runs every ` +
    `${plural(tr.eval_every, "step")})`;
  return "no evaluations yet: --eval-every N with --eval-prompts FILE and " +
    "--eval-reward-functions module:fn turn the eval gate on";
}

// The loss, and the terms that are on beside it: a term whose coefficient is 0 is said to be
// off, not drawn as a flat line at 0. With training off the settings are not known here: a term
// is drawn if the records have it.
const TERMS = [
  {name: "KL", key: "kl", coef: "kl_coef", flag: "--kl-coef", color: "#9467bd"},
  {name: "entropy", key: "entropy", coef: "entropy_coef", flag: "--entropy-coef",
   color: "#2ca02c"}];

function lossChart(steps, tr) {
  const on = term => tr.enabled ? tr[term.coef] > 0 : steps.some(s => s[term.key]);
  const drawn = TERMS.filter(on), off = TERMS.filter(term => !on(term));
  const note = tr.enabled && off.length ? el("p", {class: "terms", id: "terms-off"},
    off.map(term => `${term.name}: off (${term.flag} 0)`).join(" · ")) : null;
  const names = ["Loss", ...drawn.map(term => term.name)];
  const title = names.length > 1 ? names.slice(0, -1).join(", ") + " and " + names.at(-1) : "Loss";
  return lineChart(title, "chart-loss", [
    {name: "loss", color: "#d62728", pts: steps.map(s => [s.step, s.loss])},
    ...drawn.map(term => ({name: term.name, color: term.color,
                           pts: steps.map(s => [s.step, s[term.key]])}))],
    {xlabel: "step", empty: "no optimizer steps yet", note});
}

const LIVE = {xlabel: "minutes (0 = now)", xwhole: false, xspan: [-1, 0]};

// ---- pages ----

function header(model, version, tr) {
  // the state in words is the server's (ops/status.py), the same as `rlproxy status` says
  const where = tr.backend === "tinker" ? ` on ${tr.url} (run ${tr.run})` : "";
  document.getElementById("status").textContent =
    `${model} · adapter v${version} · trainer ${tr.state_text}${where}`;
}

async function overview() {
  const d = await api("/ui/api/overview");
  const steps = d.steps;
  const reward = steps.filter(s => s.reward_mean !== null).map(s => [s.step, s.reward_mean]);
  const rollbacks = d.events.filter(e => e.kind === "rollback" && e.step !== undefined)
    .map(e => ({x: e.step, label: e.gate ? `rollback: ${e.reason}` : "rollback (operator)"}));
  const live = d.live.map(p => Object.assign({}, p, {x: (p.t - Date.now() / 1000) / 60}));
  const tr = d.trainer, sc = d.scoring, today = d.today;
  const evals = d.evals, refused = evals.filter(e => !e.passed);
  header(d.model, d.adapter_version, tr);
  return el("div", {},
    ...(tr.error ? [el("p", {class: "error"}, `trainer: ${tr.error}`)] : []),
    el("h2", {}, "Today"),
    el("div", {class: "counters", id: "counters"},
      counter("turns recorded", today.turns || 0), counter("sessions", today.sessions || 0),
      counter("prompt tokens", today.prompt_tokens || 0),
      counter("completion tokens", today.completion_tokens || 0),
      counter("optimizer steps", today.steps || 0), counter("sessions open", d.sessions_open),
      counter("turns scored", sc.scored), counter("released to training", sc.released),
      counter("waiting for a judge", sc.pending), counter("trainer step", tr.step ?? "off"),
      counter("released, not trained yet", tr.untrained ?? 0),
      counter("adapter version", d.adapter_version), recordsCounter(d.records)),
    el("h2", {}, "Learning"),
    tr.waiting ? el("p", {class: "note", id: "trainer-waiting"}, tr.waiting) : null,
    el("div", {class: "grid"},
      lineChart("Reward per optimizer step", "chart-reward", [
        {name: "reward (step mean)", color: "#1f77b4", pts: reward, dots: true},
        {name: "rolling mean (10)", color: "#ff7f0e", pts: rolling(reward, 10)}],
        {xlabel: "step (dashed red: rollbacks)", ymin: -1, ymax: 1, marks: rollbacks,
         empty: "no optimizer steps yet"}),
      lineChart("Held-out reward (eval gate)", "chart-heldout", [
        {name: "candidate", color: "#2ca02c", pts: evals.map(e => [e.step, e.reward]),
         dots: true},
        {name: "served", color: "#7f7f7f", pts: evals.map(e => [e.step, e.served_reward])},
        ...(refused.length ? [{name: "refused", color: "#d62728", dots: true, line: false,
                               pts: refused.map(e => [e.step, e.reward])}] : [])],
        {xlabel: "step", ymin: -1, ymax: 1, empty: heldOutEmpty(evals, tr)}),
      lossChart(steps, tr),
      judgePanel(sc)),
    el("h2", {}, "Serving (last 30 minutes)"),
    el("div", {class: "grid"},
      lineChart("Time to first token (s)", "chart-ttft", [
        {name: "p50", color: "#2ca02c", pts: live.map(p => [p.x, p.ttft_p50])},
        {name: "p95", color: "#d62728", pts: live.map(p => [p.x, p.ttft_p95])}],
        {...LIVE, ymin: 0, empty: "no requests timed yet"}),
      lineChart("Prefix cache hit rate", "chart-cache", [
        {name: "hits / lookups", color: "#17becf", pts: live.map(p => [p.x, p.cache_hit_rate])}],
        {...LIVE, ymin: 0, ymax: 1, empty: "no prefix-cache lookups yet"}),
      lineChart("Tokens per second", "chart-tps", [
        {name: "generated", color: "#8c564b", pts: live.map(p => [p.x, p.tokens_per_s])}],
        {...LIVE, ymin: 0, empty: "no samples yet"}),
      lineChart("Speculation (lone streams)", "chart-spec", [
        {name: "drafts accepted", color: "#9467bd",
         pts: live.map(p => [p.x, p.spec_acceptance])},
        {name: "tokens per step / 10", color: "#e377c2",
         pts: live.map(p => [p.x, p.spec_tokens_per_step == null ? null
                                  : p.spec_tokens_per_step / 10])}],
        {...LIVE, ymin: 0, ymax: 1, empty: "no speculated streams yet (--speculate ngram)"})));
}

function sessionTable(rows, open) {
  return el("table", {},
    el("tr", {}, el("th", {}, "session"), el("th", {}, "turns"), el("th", {}, "trained"),
      el("th", {}, "mean reward"), el("th", {}, open ? "last active" : "last turn")),
    ...rows.map(s => el("tr", {},
      el("td", {}, el("a", {href: "#/session/" + encodeURIComponent(s.id)}, s.id)),
      el("td", {}, fmt(s.turns)), el("td", {}, fmt(s.trained)),
      el("td", {}, fmt(s.reward_mean, 2)), el("td", {}, when(s.last_active || s.last)))));
}

async function sessions() {
  const d = await api("/ui/api/sessions");
  return el("div", {},
    el("h2", {}, `Open sessions (${d.open.length})`), sessionTable(d.open, true),
    el("h2", {}, "Recent sessions"), sessionTable(d.recent, false));
}

function messages(list) {
  return el("div", {}, ...list.map(m => el("pre", {},
    `${m.role}: ${m.content ?? ""}` + (m.tool_calls ? "\n" + JSON.stringify(m.tool_calls) : ""))));
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

// What is known of a turn, unknown parts left out (an open turn has no score or training yet).
function turnHeader(t) {
  const known = v => v !== undefined && v !== null && v !== "";
  const tokens = !known(t.prompt_tokens) ? null : known(t.completion_tokens) ?
    `${fmt(t.prompt_tokens)}+${fmt(t.completion_tokens)} tokens` :
    `${fmt(t.prompt_tokens)} prompt tokens`;
  const versions = t.adapter_versions || [];
  return [`#${t.index}`, t.pending ? "pending" : null, t.turn_type, t.api,
          known(t.received) ? when(t.received) : null, tokens,
          versions.length ? "adapter " + versions.map(v => "v" + v).join(",") : null]
    .filter(known).join(" · ");
}

function turnCard(t) {
  const calls = (t.tool_calls || []).map(c => `${c.function.name}(${c.function.arguments})`);
  const reward = t.release ? `${fmt(t.release.reward, 2)} (${t.release.reason})` :
    t.score_reward !== undefined && t.score_reward !== null ? `${fmt(t.score_reward, 2)} (held)` :
    "not scored yet";
  const trained = t.trained ? `yes, step ${t.trained.step}` +
    (t.trained.time ? ` at ${when(t.trained.time)}` : "") :
    t.skipped ? `skipped: ${t.skipped}` : t.turn_type === "side" ? "no (side turn)" : "not yet";
  return el("div", {class: "card turn", "data-uid": t.uid},
    el("h3", {}, turnHeader(t)),
    el("div", {class: "label"}, "prompt (tail)"), messages(t.prompt_tail || []),
    el("div", {class: "label"}, "reply"), el("pre", {class: "reply"}, t.reply ?? ""),
    calls.length ? el("div", {class: "label"}, "tool calls") : null,
    calls.length ? el("pre", {}, calls.join("\n")) : null,
    el("div", {class: "label"}, "next state"),
    t.next_state ? el("div", {class: "next-state"}, messages(t.next_state))
                 : el("pre", {}, `(none: ${t.end})`),
    (t.votes || []).length ? el("div", {class: "label"}, "judge votes") : null,
    ...(t.votes || []).map(v => el("pre", {}, `vote ${fmt(v.vote)}: ${v.text ?? v.error}`)),
    t.hint ? el("pre", {}, "hint: " + t.hint) : null,
    el("div", {class: "label"}, "reward"), el("div", {class: "reward"}, reward),
    t.feedback ? el("div", {}, `feedback ${t.feedback.reward}: ${t.feedback.comment ?? ""}`) : null,
    el("div", {class: "label"}, "trained"), el("div", {class: "trained"}, trained));
}

function pager(d) {
  // start undefined: the latest page (the server's default)
  const link = (start, text) => el("a", {href: "#/session/" + encodeURIComponent(d.id) +
    (start === undefined ? "" : "/" + start)}, text);
  const last = d.start + d.page >= d.recorded_turns;
  const shown = d.turns.length + d.waiting.length;  // the open turns come on the last page
  return el("p", {class: "pager"},
    `turns ${shown ? d.start + 1 : 0}–${d.start + shown} of ${d.recorded_turns + d.pending_turns} `,
    d.start > 0 ? link(0, "« first") : null, " ",
    d.start > 0 ? link(Math.max(0, d.start - d.page), "‹ earlier") : null, " ",
    last ? null : link(d.start + d.page, "later ›"), " ",
    last ? null : link(undefined, "latest »"));
}

async function session(id, start) {
  const d = await api("/ui/api/sessions/" + encodeURIComponent(id) +
                      (start === undefined ? "" : "?start=" + start));
  return el("div", {},
    el("h2", {}, `Session ${d.id} · ${d.open ? "open" : "closed" + (d.closed ? " (" + d.closed + ")" : "")}` +
      ` · ${plural(d.recorded_turns + d.pending_turns, "turn")}` +
      (d.pending_turns ? ` (${d.recorded_turns} recorded, ${d.pending_turns} pending)` : "")),
    pager(d), ...d.turns.map(turnCard), ...d.waiting.map(turnCard),
    d.turns.length > 10 ? pager(d) : null);
}

let saving = false;
let saved = null;  // the last "Save checkpoint now": the server's answer, or {error}

async function saveCheckpoint() {
  saving = true;
  route();  // the button shows "Saving…" until the answer
  try { saved = await api("/ui/api/checkpoints", {method: "POST"}); }
  catch (e) { saved = {error: e.message}; }
  saving = false;
  route();
}

function savedNote() {
  if (saved === null) return null;
  if (saved.error) {
    return el("p", {class: "neg", id: "saved"}, "Could not save a checkpoint: " + saved.error);
  }
  return el("p", {id: "saved"},
    `Saved step ${saved.step} (adapter v${saved.adapter_version}) to ${saved.path}: `,
    el("a", {href: `/ui/api/adapters/${encodeURIComponent(saved.step)}.zip`,
             id: "saved-download"}, "download .zip"));
}

async function act(path) {
  try { await api(path, {method: "POST"}); } catch (e) { alert(e.message); }
  route();
}

async function adapters() {
  const d = await api("/ui/api/adapters");
  const tr = d.trainer;
  header(d.model, d.served_version, tr);
  return el("div", {},
    el("h2", {}, `Served adapter version ${d.served_version}`),
    el("p", {class: "actions"},
      tr.enabled ? el("button", {id: "pause", onclick: () =>
        act(tr.paused ? "/ui/api/training/resume" : "/ui/api/training/pause")},
        tr.paused ? "Resume training" : "Pause training") : "Training is off (--no-train). ",
      el("button", Object.assign({id: "save-checkpoint", onclick: saveCheckpoint},
                                 saving ? {disabled: ""} : {}),
         saving ? "Saving…" : "Save checkpoint now")),
    savedNote(),
    el("h2", {}, "Checkpoints"),
    el("table", {},
      el("tr", {}, ...["step", "adapter version", "saved", "reward (5 steps)", "loss (5 steps)",
                       "", ""].map(h => el("th", {}, h))),
      ...d.checkpoints.map(c => el("tr", {},
        el("td", {}, c.step),
        el("td", {}, c.adapter_version + (c.adapter_version === d.served_version ? " (served)" : "")),
        el("td", {}, when(c.time)),
        el("td", {}, fmt(c.reward_mean, 3)), el("td", {}, fmt(c.loss_mean, 4)),
        el("td", {}, el("a", {href: `/ui/api/adapters/${c.step}.zip`}, "download .zip"), " ",
          el("a", {href: `/ui/api/adapters/${c.step}.peft.zip`, class: "peft"},
             "download as PEFT")),
        el("td", {}, el("button", {onclick: () => {
          if (confirm(`Serve the adapter of step ${c.step} as a new version?`))
            act(`/ui/api/adapters/${c.step}/serve`);
        }}, "serve this one"))))),
    el("h2", {}, "Actions"),
    d.events.length ? null : el("p", {}, "No rollback or pause yet."),
    el("table", {}, ...d.events.map(e => el("tr", {}, el("td", {}, e.kind),
      el("td", {}, e.kind === "rollback" && e.gate ?
        `eval gate, step ${e.step}: candidate v${e.rejected_version} refused (${e.reason}); ` +
        `back to step ${e.checkpoint_step}'s adapter v${e.adapter_version}, learning rate ` +
        `x${e.lr_scale}` :
        e.kind === "rollback" ? `to step ${e.checkpoint_step} as adapter v${e.adapter_version}` :
        `at step ${e.step}${e.reason ? ": " + e.reason : ""}`), el("td", {}, when(e.time))))));
}

// Draws the page the hash names, then says so on <body>: data-state "loaded" (and data-loaded,
// the hash) only once that page's data is in the view, so a screenshot or a test that waits
// for it never sees a blank page; "loading" before, "error" when it could not be loaded.
async function route() {
  clearTimeout(timer);
  const mine = ++routed;
  const hash = location.hash || "#/";
  if (hash !== shown) document.body.dataset.state = "loading";
  let page, every = 5000;
  if (hash.startsWith("#/session/")) {
    const [id, start] = hash.slice("#/session/".length).split("/");  // the id is encoded
    page = () => session(decodeURIComponent(id), start === undefined ? undefined : Number(start));
  } else if (hash === "#/sessions") page = sessions;
  else if (hash === "#/adapters") page = adapters;
  else { page = overview; every = 3000; }
  let node, failed = false;
  try {
    node = await page();
  } catch (e) {
    node = el("p", {class: "neg"}, "Could not load: " + e.message);
    failed = true;
  }
  if (mine !== routed) return;  // the hash changed, or a button routed again, meanwhile
  view.replaceChildren(node);
  shown = failed ? null : hash;
  document.body.dataset.state = failed ? "error" : "loaded";
  if (!failed) document.body.dataset.loaded = hash;
  timer = setTimeout(route, every);
}

window.addEventListener("hashchange", route);
route();
