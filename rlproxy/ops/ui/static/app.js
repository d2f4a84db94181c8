// The rlproxy dashboard: three pages drawn from /ui/api/*. No framework, no build step.
// Every recorded value is put into the page as text (textContent), never as HTML: agent
// content is untrusted.
"use strict";

const view = document.getElementById("view");
let timer = null;

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
  const body = await r.json();
  if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
  return body;
}

const fmt = (x, d = 3) => (x === null || x === undefined) ? "–" :
  (typeof x !== "number" ? String(x) : Number.isInteger(x) ? String(x) :
   x.toFixed(d).replace(/^-(0\.?0*)$/, "$1"));  // no "-0.0"
const when = (t) => t ? new Date(t * 1000).toLocaleString() : "–";

// ---- charts: SVG drawn here ----

function lineChart(title, id, series, opts = {}) {
  // opts.marks: [{x, label}] drawn as dashed red vertical lines (the eval gate's rollbacks);
  // opts.empty: what the card says when there is nothing to draw (no bare axes)
  const w = 440, h = 200, l = 48, r = 14, t = 22, b = 36;
  const all = series.flatMap(s => s.pts).filter(p => p[1] !== null && isFinite(p[1]));
  const marks = opts.marks || [];
  if (!all.length && !marks.length) {
    return el("div", {class: "card"}, el("h3", {}, title),
              el("p", {class: "empty", id}, opts.empty || "no data yet"));
  }
  const xs = all.map(p => p[0]).concat(marks.map(m => m.x));
  const box = svg("svg", {id, width: "100%", viewBox: `0 0 ${w} ${h}`});
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = opts.ymin ?? Math.min(...all.map(p => p[1]));
  let y1 = opts.ymax ?? Math.max(...all.map(p => p[1]));
  if (!all.length) { y0 = opts.ymin ?? 0; y1 = opts.ymax ?? 1; }
  if (!xs.length) { x0 = 0; x1 = 1; }
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += 1; y0 -= 1; }
  const X = x => l + (w - l - r) * (x - x0) / (x1 - x0);
  const Y = y => t + (h - t - b) * (1 - (y - y0) / (y1 - y0));
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    box.append(svg("line", {x1: l, x2: w - r, y1: Y(y), y2: Y(y), stroke: "#eee"}));
    const label = svg("text", {x: l - 4, y: Y(y) + 4, "text-anchor": "end"});
    label.textContent = fmt(y, 2);
    box.append(label);
  }
  const digits = opts.xdigits ?? 0;
  // a whole-number axis (steps) ticks whole numbers: steps 1..2 get "1 2", not "1 1 2 2 2"
  const ticks = new Set([0, 1, 2, 3, 4].map(i => x0 + (x1 - x0) * i / 4)
    .map(x => digits ? x : Math.round(x)));
  for (const x of ticks) {
    const tick = svg("text", {x: X(x), y: h - b + 14, "text-anchor": "middle"});
    tick.textContent = fmt(x, digits);
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
    const pts = s.pts.filter(p => p[1] !== null && isFinite(p[1]));
    if (pts.length && s.line !== false) {
      box.append(svg("polyline", {points: pts.map(p => `${X(p[0])},${Y(p[1])}`).join(" "),
                                  fill: "none", stroke: s.color, "stroke-width": 1.5}));
    }
    if (s.dots) for (const p of pts) {
      box.append(svg("circle", {cx: X(p[0]), cy: Y(p[1]), r: s.line === false ? 4 : 2.5,
                                fill: s.line === false ? "none" : s.color, stroke: s.color,
                                class: "pt"}));
    }
    const key = svg("text", {x: l + 150 * k++, y: 13, fill: s.color});
    key.textContent = s.name;
    key.setAttribute("style", `fill:${s.color}`);
    box.append(key);
  }
  return el("div", {class: "card"}, el("h3", {}, title), box);
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

// ---- pages ----

async function overview() {
  const d = await api("/ui/api/overview");
  const steps = d.steps;
  const reward = steps.filter(s => s.reward_mean !== null).map(s => [s.step, s.reward_mean]);
  const rollbacks = d.events.filter(e => e.kind === "rollback" && e.step !== undefined)
    .map(e => ({x: e.step, label: e.gate ? `rollback: ${e.reason}` : "rollback (operator)"}));
  const live = d.live.map(p => Object.assign({}, p, {x: (p.t - Date.now() / 1000) / 60}));
  const tr = d.trainer, sc = d.scoring, today = d.today;
  const evals = d.evals, refused = evals.filter(e => !e.passed);
  const where = tr.backend === "tinker" ? ` on ${tr.url} (run ${tr.run})` : "";
  // the state in words is the server's (ops/status.py), the same as `rlproxy status` says
  document.getElementById("status").textContent =
    `${d.model} · adapter v${d.adapter_version} · trainer ${tr.state}${where}`;
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
      counter("adapter version", d.adapter_version)),
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
      lineChart("Loss and KL", "chart-loss", [
        {name: "loss", color: "#d62728", pts: steps.map(s => [s.step, s.loss])},
        {name: "KL", color: "#9467bd", pts: steps.map(s => [s.step, s.kl])}],
        {xlabel: "step", empty: "no optimizer steps yet"}),
      judgePanel(sc)),
    el("h2", {}, "Serving (last 30 minutes)"),
    el("div", {class: "grid"},
      lineChart("Time to first token (s)", "chart-ttft", [
        {name: "p50", color: "#2ca02c", pts: live.map(p => [p.x, p.ttft_p50])},
        {name: "p95", color: "#d62728", pts: live.map(p => [p.x, p.ttft_p95])}],
        {xlabel: "minutes (0 = now)", ymin: 0, xdigits: 1, empty: "no requests timed yet"}),
      lineChart("Prefix cache hit rate", "chart-cache", [
        {name: "hits / lookups", color: "#17becf", pts: live.map(p => [p.x, p.cache_hit_rate])}],
        {xlabel: "minutes (0 = now)", ymin: 0, ymax: 1, xdigits: 1,
         empty: "no prefix-cache lookups yet"}),
      lineChart("Tokens per second", "chart-tps", [
        {name: "generated", color: "#8c564b", pts: live.map(p => [p.x, p.tokens_per_s])}],
        {xlabel: "minutes (0 = now)", ymin: 0, xdigits: 1, empty: "no samples yet"})));
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

async function act(path) {
  try { await api(path, {method: "POST"}); } catch (e) { alert(e.message); }
  route();
}

async function adapters() {
  const d = await api("/ui/api/adapters");
  const tr = d.trainer;
  return el("div", {},
    el("h2", {}, `Served adapter version ${d.served_version}`),
    tr.enabled ? el("button", {id: "pause", onclick: () =>
      act(tr.paused ? "/ui/api/training/resume" : "/ui/api/training/pause")},
      tr.paused ? "Resume training" : "Pause training")
      : el("p", {}, "Training is off (--no-train)."),
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

async function route() {
  clearTimeout(timer);
  const hash = location.hash || "#/";
  let page, every = 5000;
  if (hash.startsWith("#/session/")) {
    const [id, start] = hash.slice("#/session/".length).split("/");  // the id is encoded
    page = () => session(decodeURIComponent(id), start === undefined ? undefined : Number(start));
  } else if (hash === "#/sessions") page = sessions;
  else if (hash === "#/adapters") page = adapters;
  else { page = overview; every = 3000; }
  try {
    const node = await page();
    view.replaceChildren(node);
    document.body.dataset.loaded = hash;
  } catch (e) {
    view.replaceChildren(el("p", {class: "neg"}, "Could not load: " + e.message));
  }
  timer = setTimeout(route, every);
}

window.addEventListener("hashchange", route);
route();
