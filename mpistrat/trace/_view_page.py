"""The page of :mod:`mpistrat.trace.view`: HTML, CSS and the canvas timeline's script.

Kept as Python strings (not a data file) so that every install carries it. The script
reads only the embedded ``trace-data`` JSON and builds the tooltip and legend with
``textContent``, never ``innerHTML``: a name in the trace is drawn, never parsed.
"""

from __future__ import annotations

__all__ = ["PAGE", "SCRIPT"]

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; \
script-src '{{SCRIPT_HASH}}'; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>
html, body { margin: 0; height: 100%; font: 13px system-ui, "DejaVu Sans", sans-serif;
  color: #1d2430; background: #fff; }
body { display: flex; flex-direction: column; }
header { padding: 6px 10px 4px; border-bottom: 1px solid #d8dde5; background: #f7f8fa; }
h1 { font-size: 15px; margin: 0 0 2px; font-weight: 600; overflow-wrap: anywhere; }
#info { color: #4a5464; }
#info .warn { color: #a4262c; }
#legend { margin-top: 4px; display: flex; flex-wrap: wrap; gap: 2px 12px; }
#legend span { cursor: pointer; user-select: none; white-space: nowrap; }
#legend span.off { opacity: 0.35; text-decoration: line-through; }
#legend i { display: inline-block; width: 11px; height: 11px; margin-right: 4px;
  vertical-align: -1px; border: 1px solid rgba(0,0,0,0.25); }
#view { position: relative; flex: 1; min-height: 200px; overflow: hidden; }
canvas { position: absolute; left: 0; top: 0; width: 100%; height: 100%; cursor: grab; }
canvas.drag { cursor: grabbing; }
#tip { position: absolute; pointer-events: none; background: #fffff4; border: 1px solid #9aa3b0;
  box-shadow: 0 2px 6px rgba(0,0,0,0.2); padding: 5px 7px; max-width: 460px; font-size: 12px;
  white-space: pre-wrap; overflow-wrap: anywhere; z-index: 2; }
#tip b { display: block; margin-bottom: 2px; }
#tip table { border-collapse: collapse; margin-top: 3px; }
#tip td { padding: 0 6px 0 0; vertical-align: top; }
#tip td:first-child { color: #4a5464; white-space: nowrap; }
</style>
</head>
<body>
<header>
<h1>{{TITLE}}</h1>
<div id="info">loading…</div>
<div id="legend"></div>
</header>
<div id="view"><canvas id="timeline"></canvas><div id="tip" hidden></div></div>
<script type="application/json" id="trace-data">{{DATA}}</script>
<script>{{SCRIPT}}</script>
</body>
</html>
"""

SCRIPT = r"""
(function () {
"use strict";
var info = document.getElementById("info");
window.onerror = function (msg) { info.textContent = "the timeline failed: " + msg; };
var D = JSON.parse(document.getElementById("trace-data").textContent);
var ROW = 18, BAND = 22, GAP = 4, GUTTER = 190, AXIS = 28, MICRO = "\u00b5s";
var canvas = document.getElementById("timeline"), ctx = canvas.getContext("2d");
var tip = document.getElementById("tip"), view = document.getElementById("view");
var threads = D.threads, procs = D.processes, keys = D.keys, names = D.names;
var hidden = {};

// rows: per thread, per depth, the spans in time order (at one depth they do not
// overlap, so their ends are in order too); instants per thread
var rows = threads.map(function () { return []; });
var instants = threads.map(function () { return []; });
D.events.forEach(function (e) {
  if (e[1] < 0) { instants[e[4]].push(e); return; }
  var r = rows[e[4]];
  while (r.length <= e[5]) r.push([]);
  r[e[5]].push(e);
});
var height = 0;
procs.forEach(function (p) {
  p.y = height; height += BAND;
  p.threads.forEach(function (t) {
    var th = threads[t];
    th.y = height; th.depth = Math.max(1, rows[t].length);
    height += th.depth * ROW + GAP;
  });
  height += 6;
});

var W = 0, H = 0, dpr = 1, t0 = D.span[0], t1 = D.span[1], scrollY = 0;
var full = fullView();
function fullView() {
  var pad = Math.max((D.span[1] - D.span[0]) * 0.01, 1);
  return [D.span[0] - pad, D.span[1] + pad];
}
(function initialView() {
  var q = new URLSearchParams(location.search);
  var a = parseFloat(q.get("from")), b = parseFloat(q.get("to"));
  if (isFinite(a) && isFinite(b) && b > a) { t0 = a * 1000; t1 = b * 1000; return; }
  if (D.view) { t0 = D.view[0] * 1000; t1 = D.view[1] * 1000; return; }
  t0 = full[0]; t1 = full[1];
})();

function x(t) { return GUTTER + (t - t0) / (t1 - t0) * (W - GUTTER); }
function timeAt(px) { return t0 + (px - GUTTER) / (W - GUTTER) * (t1 - t0); }
function fmtDur(us) {
  if (us >= 1000) return (us / 1000).toFixed(us >= 1e5 ? 1 : 3) + " ms";
  return us.toFixed(us >= 10 ? 1 : 3) + " " + MICRO;
}
function textColor(hex) {
  var n = parseInt(hex.slice(1), 16);
  var l = 0.299 * (n >> 16) + 0.587 * ((n >> 8) & 255) + 0.114 * (n & 255);
  return l > 140 ? "#1d2430" : "#ffffff";
}
var colors = keys.map(function (k) { return k.color; });
var inks = keys.map(function (k) { return textColor(k.color); });

// the first span of a row whose end is at or after t
function firstEnding(row, t) {
  var lo = 0, hi = row.length;
  while (lo < hi) {
    var mid = (lo + hi) >> 1;
    if (row[mid][0] + row[mid][1] < t) lo = mid + 1; else hi = mid;
  }
  return lo;
}
function firstAt(list, t) {
  var lo = 0, hi = list.length;
  while (lo < hi) { var mid = (lo + hi) >> 1; if (list[mid][0] < t) lo = mid + 1; else hi = mid; }
  return lo;
}

function resize() {
  dpr = window.devicePixelRatio || 1;
  W = view.clientWidth; H = view.clientHeight;
  canvas.width = Math.round(W * dpr); canvas.height = Math.round(H * dpr);
  clampScroll(); draw();
}
function clampScroll() {
  scrollY = Math.max(0, Math.min(scrollY, Math.max(0, height - (H - AXIS) + 10)));
}

var drawn = 0;
function draw() {
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, W, H);
  ctx.font = "11px system-ui, 'DejaVu Sans', sans-serif";
  ctx.textBaseline = "middle";
  var ticks = axisTicks();
  drawn = 0;
  ctx.save();
  ctx.beginPath(); ctx.rect(0, AXIS, W, H - AXIS); ctx.clip();
  procs.forEach(function (p, pi) {
    var py = AXIS + p.y - scrollY;
    var last = threads[p.threads[p.threads.length - 1]];
    var bottom = AXIS + last.y + last.depth * ROW - scrollY;
    if (bottom < AXIS || py > H) return;
    ctx.fillStyle = "#e8ecf2"; ctx.fillRect(0, py, W, BAND - 2);
    ctx.fillStyle = "#1d2430"; ctx.font = "bold 12px system-ui, 'DejaVu Sans', sans-serif";
    ctx.fillText(p.name, 6, py + BAND / 2 - 1);
    ctx.font = "11px system-ui, 'DejaVu Sans', sans-serif";
    p.threads.forEach(function (t, ti) { drawThread(t, ti); });
  });
  ctx.restore();
  drawAxis(ticks);
  updateInfo();
  document.body.setAttribute("data-drawn", String(drawn));
}

function drawThread(t, ti) {
  var th = threads[t], ty = AXIS + th.y - scrollY, h = th.depth * ROW;
  if (ty + h < AXIS || ty > H) return;
  ctx.fillStyle = ti % 2 ? "#fafbfc" : "#ffffff"; ctx.fillRect(0, ty, W, h);
  ctx.save();
  ctx.beginPath(); ctx.rect(GUTTER, ty, W - GUTTER, h); ctx.clip();
  var tol = (t1 - t0) / (W - GUTTER);
  rows[t].forEach(function (row, d) {
    var ry = ty + d * ROW, lastPx = -1;
    for (var i = firstEnding(row, t0); i < row.length && row[i][0] <= t1; i++) {
      var e = row[i];
      if (hidden[e[3]]) continue;
      var a = x(e[0]), b = x(e[0] + e[1]);
      if (b - a < 1) {                           // a sliver: one pixel column at most
        if (Math.floor(a) === lastPx) continue;
        lastPx = Math.floor(a); b = a + 1;
      }
      ctx.fillStyle = colors[e[3]];
      ctx.fillRect(a, ry + 1, b - a, ROW - 2);
      drawn++;
      var w = Math.min(b, W) - Math.max(a, GUTTER);
      if (w > 24) {
        var name = names[e[2]], fit = Math.floor((w - 6) / 6.2);
        if (fit >= 2) {
          if (name.length > fit) name = name.slice(0, fit - 1) + "\u2026";
          ctx.fillStyle = inks[e[3]];
          ctx.fillText(name, Math.max(a, GUTTER) + 3, ry + ROW / 2);
        }
      }
    }
  });
  instants[t].forEach(function (e) {
    if (hidden[e[3]] || e[0] < t0 - tol * 5 || e[0] > t1 + tol * 5) return;
    var px = x(e[0]);
    ctx.fillStyle = colors[e[3]]; ctx.strokeStyle = "#1d2430";
    ctx.beginPath(); ctx.moveTo(px - 5, ty + 1); ctx.lineTo(px + 5, ty + 1);
    ctx.lineTo(px, ty + 10); ctx.closePath(); ctx.fill(); ctx.stroke();
    drawn++;
  });
  ctx.restore();
  ctx.fillStyle = "#4a5464";
  var label = th.name.length > 28 ? th.name.slice(0, 27) + "\u2026" : th.name;
  ctx.fillText(label, 14, ty + ROW / 2);
}

function axisTicks() {
  var span = (t1 - t0) / 1000, want = Math.max(2, (W - GUTTER) / 110);
  var raw = span / want, mag = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / mag;
  var step = mag * (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10);
  var digits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  var out = [];
  for (var v = Math.ceil(t0 / 1000 / step) * step; v <= t1 / 1000; v += step) {
    out.push([x(v * 1000), v.toFixed(digits)]);
  }
  return out;
}
function drawAxis(ticks) {
  ctx.fillStyle = "#f7f8fa"; ctx.fillRect(0, 0, W, AXIS);
  ctx.strokeStyle = "#c4cad3"; ctx.beginPath(); ctx.moveTo(0, AXIS - 0.5);
  ctx.lineTo(W, AXIS - 0.5); ctx.stroke();
  ctx.fillStyle = "#4a5464"; ctx.fillText("time (ms)", 6, AXIS / 2);
  ctx.save();
  ctx.beginPath(); ctx.rect(GUTTER, 0, W - GUTTER, H); ctx.clip();
  ticks.forEach(function (tk) {
    ctx.strokeStyle = "rgba(60,70,90,0.13)";
    ctx.beginPath(); ctx.moveTo(Math.round(tk[0]) + 0.5, AXIS);
    ctx.lineTo(Math.round(tk[0]) + 0.5, H); ctx.stroke();
    ctx.strokeStyle = "#7a8494";
    ctx.beginPath(); ctx.moveTo(Math.round(tk[0]) + 0.5, AXIS - 6);
    ctx.lineTo(Math.round(tk[0]) + 0.5, AXIS); ctx.stroke();
    ctx.fillStyle = "#1d2430"; ctx.fillText(tk[1], tk[0] + 3, AXIS / 2 - 2);
  });
  ctx.restore();
  ctx.strokeStyle = "#c4cad3"; ctx.beginPath(); ctx.moveTo(GUTTER - 0.5, 0);
  ctx.lineTo(GUTTER - 0.5, H); ctx.stroke();
}

var infoText = null;
function updateInfo() {
  if (!infoText) {
    info.textContent = "";
    var n = D.events.length, ranks = procs.length;
    var parts = [n + " events", ranks + (ranks === 1 ? " process" : " processes")];
    info.appendChild(document.createTextNode(parts.join(" \u00b7 ") + " \u00b7 "));
    infoText = document.createElement("span"); info.appendChild(infoText);
    var skipped = Object.keys(D.skipped);
    var notes = [];
    if (skipped.length) {
      var total = 0;
      skipped.forEach(function (k) { total += D.skipped[k]; });
      notes.push(total + " skipped (" + skipped.map(function (k) {
        return D.skipped[k] + " " + k; }).join(", ") + ")");
    }
    if (D.left_out) notes.push(D.left_out + " left out of the page (window or max_events)");
    if (notes.length) {
      var warn = document.createElement("span"); warn.className = "warn";
      warn.textContent = " \u00b7 " + notes.join(" \u00b7 "); info.appendChild(warn);
    }
    info.appendChild(document.createTextNode(
      " \u00b7 wheel: zoom \u00b7 drag: pan \u00b7 shift+wheel: scroll \u00b7 " +
      "double-click: whole trace"));
  }
  infoText.textContent = "view ?from=" + (t0 / 1000).toFixed(3) + "&to=" +
    (t1 / 1000).toFixed(3) + " ms";
}

function legend() {
  var box = document.getElementById("legend");
  keys.forEach(function (k, i) {
    var item = document.createElement("span"), sw = document.createElement("i");
    sw.style.background = k.color; item.appendChild(sw);
    item.appendChild(document.createTextNode(k.label + " (" + k.count + ")"));
    item.title = "click to hide or show";
    item.onclick = function () {
      hidden[i] = !hidden[i]; item.className = hidden[i] ? "off" : ""; schedule();
    };
    box.appendChild(item);
  });
}

var pending = false;
function schedule() {          // one draw per frame (a timer too, where frames pause)
  if (pending) return;
  pending = true;
  function run() { if (pending) { pending = false; draw(); } }
  requestAnimationFrame(run); setTimeout(run, 100);
}

function zoom(at, factor) {
  var span = (t1 - t0) * factor, widest = (full[1] - full[0]) * 20;
  span = Math.max(0.05, Math.min(span, widest));
  var f = (at - t0) / (t1 - t0);
  t0 = at - f * span; t1 = t0 + span; schedule();
}
function pan(us) { t0 += us; t1 += us; schedule(); }

canvas.addEventListener("wheel", function (ev) {
  ev.preventDefault();
  var scale = ev.deltaMode === 1 ? 16 : ev.deltaMode === 2 ? H : 1;
  var dx = ev.deltaX * scale, dy = ev.deltaY * scale;
  if (ev.shiftKey) { scrollY += dy || dx; clampScroll(); schedule(); return; }
  if (Math.abs(dx) > Math.abs(dy)) { pan(dx / (W - GUTTER) * (t1 - t0)); return; }
  var rect = canvas.getBoundingClientRect(), px = ev.clientX - rect.left;
  zoom(timeAt(Math.max(px, GUTTER)), Math.exp(dy * 0.0015));
}, { passive: false });

var dragFrom = null;
canvas.addEventListener("mousedown", function (ev) {
  dragFrom = { x: ev.clientX, y: ev.clientY, t0: t0, t1: t1, s: scrollY };
  canvas.className = "drag"; tip.hidden = true;
});
window.addEventListener("mouseup", function () { dragFrom = null; canvas.className = ""; });
window.addEventListener("mousemove", function (ev) {
  if (dragFrom) {
    var dt = (ev.clientX - dragFrom.x) / (W - GUTTER) * (dragFrom.t1 - dragFrom.t0);
    t0 = dragFrom.t0 - dt; t1 = dragFrom.t1 - dt;
    scrollY = dragFrom.s - (ev.clientY - dragFrom.y); clampScroll(); schedule();
    return;
  }
  var rect = canvas.getBoundingClientRect();
  hover(ev.clientX - rect.left, ev.clientY - rect.top);
});
canvas.addEventListener("mouseleave", function () { tip.hidden = true; });
canvas.addEventListener("dblclick", function () {
  full = fullView(); t0 = full[0]; t1 = full[1]; schedule();
});
window.addEventListener("keydown", function (ev) {
  var c = (t0 + t1) / 2, k = ev.key.toLowerCase();
  if (k === "w" || k === "+" || k === "=") zoom(c, 0.7);
  else if (k === "s" || k === "-") zoom(c, 1 / 0.7);
  else if (k === "a") pan(-(t1 - t0) * 0.15);
  else if (k === "d") pan((t1 - t0) * 0.15);
  else if (k === "0") { t0 = full[0]; t1 = full[1]; schedule(); }
});
window.addEventListener("resize", resize);

function eventAt(px, py) {
  if (px < GUTTER || py < AXIS) return null;
  var y = py - AXIS + scrollY, t = timeAt(px), tol = 3 * (t1 - t0) / (W - GUTTER);
  for (var i = 0; i < threads.length; i++) {
    var th = threads[i];
    if (y < th.y || y >= th.y + th.depth * ROW) continue;
    var d = Math.floor((y - th.y) / ROW), best = null;
    if (d === 0) {
      var list = instants[i];
      for (var j = firstAt(list, t - tol); j < list.length && list[j][0] <= t + tol; j++) {
        if (!hidden[list[j][3]]) return [list[j], i];
      }
    }
    var row = rows[i][d] || [];
    for (var k = firstEnding(row, t - tol); k < row.length && row[k][0] <= t + tol; k++) {
      var e = row[k];
      if (hidden[e[3]]) continue;
      if (e[0] <= t && t <= e[0] + e[1]) return [e, i];
      if (!best) best = e;
    }
    return best ? [best, i] : null;
  }
  return null;
}

function hover(px, py) {
  var found = eventAt(px, py);
  if (!found) { tip.hidden = true; return; }
  var e = found[0], th = threads[found[1]], key = keys[e[3]];
  var proc = procs.filter(function (p) { return p.threads.indexOf(found[1]) >= 0; })[0];
  tip.textContent = "";
  var title = document.createElement("b"); title.textContent = names[e[2]];
  tip.appendChild(title);
  var table = document.createElement("table");
  function line(k, v) {
    var tr = document.createElement("tr"), a = document.createElement("td"),
        b = document.createElement("td");
    a.textContent = k; b.textContent = v; tr.appendChild(a); tr.appendChild(b);
    table.appendChild(tr);
  }
  line("duration", e[1] < 0 ? "(instant)" : fmtDur(e[1]));
  line("start", (e[0] / 1000).toFixed(3) + " ms");
  line("category", key.label);
  line("where", proc.name + " \u00b7 " + th.name);
  if (e[6]) Object.keys(e[6]).forEach(function (k) {
    var v = e[6][k];
    var s = typeof v === "string" ? v : JSON.stringify(v);
    line(k, s.length > 300 ? s.slice(0, 299) + "\u2026" : s);
  });
  tip.appendChild(table);
  tip.hidden = false;
  var left = px + 14, top = py + 14;
  if (left + tip.offsetWidth > W) left = Math.max(0, px - tip.offsetWidth - 10);
  if (top + tip.offsetHeight > H) top = Math.max(0, py - tip.offsetHeight - 10);
  tip.style.left = left + "px"; tip.style.top = top + "px";
}

legend();
resize();
})();
"""
