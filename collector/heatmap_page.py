"""A self-contained interactive HTML page of per-SM heatmaps (no CDN, no network).

``render_page(heatmaps)`` embeds the heatmaps' JSON (``TimeSmHeatmap.to_dict()`` /
``SmLatencyHeatmap.to_dict()``) in one HTML file with inline CSS and JavaScript that
draws an SVG grid of ``rect.cell`` elements (one per SM x column), a GPU, kernel and
view selector, and a hover tooltip with the SM, the column (time or latency bucket) and
the value; a click on a cell opens the trace of the step whose CTA was slowest there
(``/api/v1/traces/{id}``); cells the contention tests flagged are outlined (slow red, starved
dashed blue) and the flagged SMs listed. The page works opened from disk (``sightline heatmap --out``) or served by
``/api/v1/heatmap.html``. Size: about 40 bytes per cell of JSON; the SVG holds one
element per cell (132 SMs x 18 slots = 2,376).
"""

from __future__ import annotations

import html
import json

__all__ = ["render_page"]

_CSS = """
body { font: 13px system-ui, sans-serif; margin: 16px; color: #222; }
header { display: flex; gap: 12px; align-items: center; flex-wrap: wrap; }
select { font: inherit; }
#summary { margin: 8px 0; color: #444; }
#tip { position: fixed; pointer-events: none; background: #222; color: #fff; padding: 4px 6px;
       border-radius: 3px; font-size: 12px; display: none; white-space: pre; }
rect.cell:hover { stroke: #000; stroke-width: 1; }
rect.slow { stroke: #d62728; stroke-width: 2; }
rect.starved { stroke: #1f77b4; stroke-width: 2; stroke-dasharray: 3 2; }
#contended { margin: 4px 0 8px; color: #444; }
.axis { font-size: 10px; fill: #333; }
"""

_JS = r"""
const DATA = JSON.parse(document.getElementById('heatmap-data').textContent);
const API_BASE = document.body.dataset.apiBase || '';
const $ = (id) => document.getElementById(id);
const VIRIDIS = [[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];
function colour(t) {
  t = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(t), VIRIDIS.length - 2), f = t - i;
  const c = VIRIDIS[i].map((v, k) => Math.round(v + (VIRIDIS[i + 1][k] - v) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}
function fmtS(v) {
  if (v === null || v === undefined) return '-';
  if (v < 1e-3) return (v * 1e6).toFixed(2) + ' us';
  if (v < 1) return (v * 1e3).toFixed(3) + ' ms';
  return v.toFixed(3) + ' s';
}
function options(select, values) {
  const keep = select.value;
  select.innerHTML = '';
  for (const v of values) { const o = document.createElement('option'); o.value = o.textContent = v; select.appendChild(o); }
  if (values.includes(keep)) select.value = keep;
}
function uniq(xs) { return [...new Set(xs)]; }
function refreshSelectors() {
  options($('gpu'), uniq(DATA.map(d => d.gpu)));
  options($('kernel'), uniq(DATA.filter(d => d.gpu === $('gpu').value).map(d => d.kernel)));
  options($('kind'), uniq(DATA.filter(d => d.gpu === $('gpu').value && d.kernel === $('kernel').value).map(d => d.kind)));
}
function current() {
  return DATA.find(d => d.gpu === $('gpu').value && d.kernel === $('kernel').value && d.kind === $('kind').value);
}
function draw() {
  const d = current(), svg = $('grid'), NS = 'http://www.w3.org/2000/svg';
  svg.innerHTML = '';
  if (!d) { $('summary').textContent = 'no data'; return; }
  const time = d.kind === 'time_sm';
  const grid = time ? d.p99_s : d.counts;
  const cols = grid.length ? grid[0].length : 0, rows = grid.length;
  const cw = Math.max(3, Math.min(40, Math.floor(900 / Math.max(cols, 1))));
  const ch = Math.max(3, Math.min(14, Math.floor(700 / Math.max(rows, 1))));
  const left = 60, top = 10;
  svg.setAttribute('width', left + cw * cols + 20);
  svg.setAttribute('height', top + ch * rows + 70);
  const tf = time ? (v => v) : (v => Math.log10(v));
  const vals = grid.flat().filter(v => v !== null && v > 0).map(tf);
  const lo = vals.length ? Math.min(...vals) : 0, hi = vals.length ? Math.max(...vals) : 1, span = (hi - lo) || 1;
  const hs = d.hotspot || {};
  grid.forEach((row, r) => {
    row.forEach((v, c) => {
      const e = document.createElementNS(NS, 'rect');
      e.setAttribute('class', 'cell');
      e.setAttribute('x', left + c * cw); e.setAttribute('y', top + r * ch);
      e.setAttribute('width', cw); e.setAttribute('height', ch);
      const empty = v === null || (!time && v === 0);
      e.setAttribute('fill', empty ? '#ebebeb' : colour((tf(v) - lo) / span));
      e.dataset.sm = d.sms[r];
      if (time) {
        e.dataset.col = new Date(d.times_unix_s[c] * 1000).toISOString().slice(11, 19) + ' UTC';
        e.dataset.value = empty ? 'no CTAs' : 'P99 ' + fmtS(v) + '  (' + d.counts[r][c] + ' CTAs)';
      } else {
        e.dataset.col = fmtS(d.edges_s[c]) + ' .. ' + fmtS(d.edges_s[c + 1]);
        e.dataset.value = v + ' CTAs';
      }
      const ex = time && d.exemplars ? d.exemplars[r][c] : null;
      if (ex) {
        e.dataset.trace = ex.trace_id;
        e.dataset.value += '\nslowest CTA ' + fmtS(ex.value_s) + ', step trace ' + ex.trace_id.slice(0, 16) + '...';
        e.style.cursor = 'pointer';
      }
      const score = hs.scores ? hs.scores[d.sms[r]] : undefined;
      if (score !== undefined) e.dataset.value += '\nhotspot score ' + score.toFixed(3);
      const mark = time && d.contention && d.contention[r] ? d.contention[r][c] : null;
      if (mark) {
        // slow: red outline; starved (also when it ran no CTA): dashed blue
        e.classList.add(...mark.split('+'));
        const cs = d.contention_score[r][c];
        e.dataset.value += '\ncontention: ' + mark.replace('+', ' and ') +
          (cs !== null && cs !== undefined ? ', score ' + cs.toFixed(2) : '');
      }
      svg.appendChild(e);
    });
    if (rows <= 40 || r % Math.ceil(rows / 20) === 0) {
      const t = document.createElementNS(NS, 'text');
      t.setAttribute('class', 'axis'); t.setAttribute('x', 2); t.setAttribute('y', top + r * ch + ch);
      t.textContent = 'SM ' + d.sms[r]; svg.appendChild(t);
    }
  });
  // Column ticks: latency bucket lower edges, or slot start times, about eight across.
  const every = Math.max(1, Math.ceil(cols / 8));
  for (let c = 0; c < cols; c += every) {
    const t = document.createElementNS(NS, 'text');
    t.setAttribute('class', 'axis tick'); t.setAttribute('x', left + c * cw);
    t.setAttribute('y', top + rows * ch + 12);
    t.textContent = time ? new Date(d.times_unix_s[c] * 1000).toISOString().slice(11, 19)
                         : fmtS(d.edges_s[c]);
    svg.appendChild(t);
  }
  const label = document.createElementNS(NS, 'text');
  label.setAttribute('class', 'axis'); label.setAttribute('x', left); label.setAttribute('y', top + rows * ch + 30);
  label.textContent = time ? `time (${d.slot_s} s slots) -> colour: P99 CTA duration`
                           : 'CTA duration bucket -> colour: CTA count (log scale)';
  svg.appendChild(label);
  // Colour legend: the viridis ramp from the smallest to the largest value shown.
  const legend = document.createElementNS(NS, 'g');
  legend.setAttribute('id', 'legend');
  const lx = left, ly = top + rows * ch + 38, steps = 50, lw = 200;
  for (let i = 0; i < steps; i++) {
    const r = document.createElementNS(NS, 'rect');
    r.setAttribute('x', lx + i * lw / steps); r.setAttribute('y', ly);
    r.setAttribute('width', lw / steps + 0.5); r.setAttribute('height', 8);
    r.setAttribute('fill', colour(i / (steps - 1)));
    legend.appendChild(r);
  }
  const fmtV = (v) => time ? fmtS(v) : Math.round(Math.pow(10, v)) + ' CTAs';
  for (const [x, v, anchor] of [[lx, lo, 'start'], [lx + lw, hi, 'end']]) {
    const t = document.createElementNS(NS, 'text');
    t.setAttribute('class', 'axis'); t.setAttribute('x', x); t.setAttribute('y', ly + 20);
    t.setAttribute('text-anchor', anchor); t.textContent = vals.length ? fmtV(v) : '-';
    legend.appendChild(t);
  }
  svg.appendChild(legend);
  $('summary').textContent = `GPU ${d.gpu} · ${d.kernel} · ${rows} SMs · hotspot ratio ` +
    (hs.ratio ? hs.ratio.toFixed(3) + ' (SM ' + hs.hottest_sm + ')' : '-') +
    ` · quantile error <= ${(100 * d.relative_error).toFixed(2)} %`;
  const found = Object.values(d.contended || {});
  $('contended').textContent = !time ? '' : found.length === 0 ? 'contended SMs: none flagged' :
    'contended SMs (red: slow, dashed blue: starved): ' + found.map(c =>
      `SM ${c.sm} ${c.reasons.join('+')} in ${c.slots_flagged}/${c.slots} slots` +
      (c.score !== null ? ` (score ${c.score.toFixed(2)})` : '')).join(', ');
}
const tip = $('tip');
$('grid').addEventListener('mousemove', (ev) => {
  const e = ev.target;
  if (!e.classList || !e.classList.contains('cell')) { tip.style.display = 'none'; return; }
  tip.textContent = 'SM ' + e.dataset.sm + '\n' + e.dataset.col + '\n' + e.dataset.value;
  tip.style.left = (ev.clientX + 12) + 'px'; tip.style.top = (ev.clientY + 12) + 'px';
  tip.style.display = 'block';
});
$('grid').addEventListener('mouseleave', () => { tip.style.display = 'none'; });
// A click on a cell with an exemplar opens the trace of the step whose CTA was slowest.
$('grid').addEventListener('click', (ev) => {
  const trace = ev.target.dataset && ev.target.dataset.trace;
  if (trace) window.open(API_BASE + '/api/v1/traces/' + trace, '_blank');
});
for (const id of ['gpu', 'kernel', 'kind']) $(id).addEventListener('change', () => { refreshSelectors(); draw(); });
refreshSelectors(); draw();
"""


def render_page(heatmaps: list[dict], title: str = "Sightline per-SM heatmaps", api_base: str = "") -> str:
    """One HTML document embedding ``heatmaps`` (dicts from ``to_dict()``). ``api_base``
    (e.g. ``http://127.0.0.1:8889``) is where a click on a cell looks its trace up; empty
    means the page's own origin."""
    # "</" must not appear inside the script element; JSON allows "<\/" for it.
    payload = json.dumps(heatmaps, separators=(",", ":"), allow_nan=False,
                         default=_json_default).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style></head>
<body data-api-base="{html.escape(api_base)}">
<header><strong>{html.escape(title)}</strong>
<label>GPU <select id="gpu"></select></label>
<label>kernel <select id="kernel"></select></label>
<label>view <select id="kind"></select></label></header>
<div id="summary"></div>
<div id="contended"></div>
<svg id="grid" xmlns="http://www.w3.org/2000/svg"></svg>
<div id="tip"></div>
<script id="heatmap-data" type="application/json">{payload}</script>
<script>{_JS}</script>
</body></html>
"""


def _json_default(value):
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
