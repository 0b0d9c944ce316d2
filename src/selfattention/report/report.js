// selfattention attention report. Plain JavaScript, no libraries, no network: everything it needs is in
// the JSON block (id "report-data") that selfattention.report writes into the page.
"use strict";
(function () {
  const T0 = performance.now();
  const $ = (id) => document.getElementById(id);
  const app = $("app");

  function showError(msg) {
    const box = $("error");
    box.hidden = false;
    box.textContent = tx("The report could not be drawn: {error}", { error: msg });
  }
  window.addEventListener("error", (e) => showError(e.message || String(e)));
  window.addEventListener("unhandledrejection", (e) => showError(String(e.reason && e.reason.stack || e.reason)));

  // ---------- interface language ----------
  // The page's words: English in this file, or the payload's "labels" (English text → the same text in
  // the language the report was made in, from selfattention's gettext catalog). {name} fields of a
  // template are filled from `v`. Static words in report.html carry data-t (their text) or data-t-title.
  let LABELS = {};
  function tx(s, v) {
    const x = LABELS[s] || s;
    return v ? x.replace(/\{(\w+)\}/g, (m, k) => (k in v ? String(v[k]) : m)) : x;
  }
  function translatePage(labels, lang) {
    LABELS = labels || {};
    document.documentElement.lang = lang || "en";
    for (const n of document.querySelectorAll("[data-t]")) n.textContent = tx(n.textContent.replace(/\s+/g, " ").trim());
    for (const n of document.querySelectorAll("[data-t-title]")) n.title = tx(n.title);
  }

  // ---------- small helpers ----------
  function el(tag, attrs, ...kids) {
    const n = document.createElement(tag);
    if (attrs) for (const [k, v] of Object.entries(attrs)) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") n.className = v;
      else if (k === "text") n.textContent = v;
      else if (k === "style") n.style.cssText = v;
      else if (k.startsWith("on")) n.addEventListener(k.slice(2), v);
      else n.setAttribute(k, v === true ? "" : v);
    }
    for (const c of kids.flat()) if (c !== null && c !== undefined) n.append(c instanceof Node ? c : String(c));
    return n;
  }
  function fmt(x, p) {
    p = p || 5;
    if (!Number.isFinite(x)) return String(x);
    if (x === 0) return "0";
    const a = Math.abs(x);
    if (a >= 1e-3 && a < 1e6) {
      // p significant digits, at least 4 decimals for numbers below 1
      const d = Math.max(0, p - 1 - Math.floor(Math.log10(a)));
      return x.toFixed(Math.min(d, 10));
    }
    return x.toExponential(p - 2);
  }
  const pct = (x) => (100 * x).toFixed(x < 0.1 ? 2 : 1) + "%";
  const SPECIAL = /^\[(CLS|SEP|PAD|UNK|MASK)\]$/;

  async function decode(enc) {
    const bin = atob(enc.b64);
    let bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    if (enc.deflate) {
      const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
      bytes = new Uint8Array(await new Response(stream).arrayBuffer());
    }
    const C = { f32: Float32Array, f64: Float64Array, u8: Uint8Array, i32: Int32Array }[enc.dtype];
    const n = enc.shape.reduce((a, b) => a * b, 1);
    const buf = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + n * C.BYTES_PER_ELEMENT);
    const arr = new C(buf);
    arr.shape = enc.shape;
    return arr;
  }

  // ---------- colour map: pale yellow → green → blue → navy (perceptually ordered, 0 is near white) ----------
  const STOPS = [
    [0.0, [252, 253, 244]], [0.1, [237, 248, 190]], [0.22, [199, 233, 180]], [0.36, [127, 205, 187]],
    [0.5, [65, 182, 196]], [0.64, [29, 145, 192]], [0.78, [34, 94, 168]], [0.9, [37, 52, 148]], [1.0, [8, 29, 88]],
  ];
  const LUT = new Uint8Array(256 * 3);
  for (let i = 0; i < 256; i++) {
    const t = i / 255;
    let k = 0;
    while (k < STOPS.length - 2 && t > STOPS[k + 1][0]) k++;
    const [t0, c0] = STOPS[k], [t1, c1] = STOPS[k + 1];
    const f = (t - t0) / (t1 - t0);
    for (let c = 0; c < 3; c++) LUT[3 * i + c] = Math.round(c0[c] + f * (c1[c] - c0[c]));
  }
  const rgb = (i) => `rgb(${LUT[3 * i]},${LUT[3 * i + 1]},${LUT[3 * i + 2]})`;
  // text on a coloured cell: black or white, whichever has the higher WCAG contrast with that colour
  const INK = "#101828";
  function lum(r, g, b) {
    const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  }
  const INK_LUM = lum(16, 24, 40);
  const TEXT_ON = Array.from({ length: 256 }, (_, i) => {
    const L = lum(LUT[3 * i], LUT[3 * i + 1], LUT[3 * i + 2]);
    return (1.05) / (L + 0.05) > (L + 0.05) / (INK_LUM + 0.05) ? "#ffffff" : INK;
  });
  const APPROX = new Float32Array(256);
  for (let q = 0; q < 256; q++) APPROX[q] = (q / 255) * (q / 255);

  // ---------- state ----------
  let D, T, L, H, U8, U8_INDEX = null, TOPK = null, SPECIAL_FLAGS = null;
  let exact = {};            // "l.h" -> {weights, scores, scaled, context, [query, key, value], scale}
  const approxCache = {};
  const S = { layer: 0, head: 0, token: 0, dir: "out", scale: "sqrt", metric: "entropy", showAll: false, sortByWeight: false, hover: null, unit: "tokens", measure: "raw" };
  // other views (words instead of tokens; rollout, flow, ‖α f(x)‖): D.views["unit:measure"], swapped in
  // by applyView(); BASE keeps the raw token data. VIEW: the active view (null: the raw token weights).
  let BASE = null, VIEW = null;
  const key = (l, h) => l + "." + h;

  // where head (l, h) starts in the 8-bit data, or -1 when its matrix is not stored (long inputs)
  function u8Offset(l, h) {
    if (VIEW) {
      const [vl, vh] = VIEW.dims;  // rollout: one matrix per layer; flow: one matrix
      return ((vl === 1 ? 0 : l) * vh + (vh === 1 ? 0 : h)) * T * T;
    }
    if (!U8_INDEX) return (l * H + h) * T * T;
    const i = U8_INDEX[key(l, h)];
    return i === undefined ? -1 : i * T * T;
  }
  function headWeights(l, h) {
    const e = exact[key(l, h)];
    if (e) return e.weights;
    const k = key(l, h);
    if (!approxCache[k]) {
      const off = u8Offset(l, h);
      if (off < 0) return null;
      const a = new Float32Array(T * T);
      for (let i = 0; i < T * T; i++) a[i] = APPROX[U8[off + i]];
      approxCache[k] = a;
    }
    return approxCache[k];
  }
  function colourIndex(v, rowMax) {
    let t;
    if (S.scale === "linear") t = v;
    else if (S.scale === "row") t = rowMax > 0 ? v / rowMax : 0;
    else t = Math.sqrt(Math.max(v, 0));
    return Math.max(0, Math.min(255, Math.round(t * 255)));
  }
  function rowMaxes(w) {
    const m = new Float32Array(T);
    for (let i = 0; i < T; i++) { let x = 0; for (let j = 0; j < T; j++) x = Math.max(x, w[i * T + j]); m[i] = x; }
    return m;
  }

  // ---------- header ----------
  function renderHeader() {
    document.title = tx("{title} · attention report", { title: D.title });
    $("title").textContent = D.title;
    $("subtitle").textContent = D.subtitle || "";
    const facts = $("facts");
    for (const [k, v] of D.facts) facts.append(el("div", null, el("dt", { text: k }), el("dd", { text: v })));
    $("caveat-text").textContent = D.caveat;
    $("caveat-zh").textContent = D.caveat_zh || "";
    const notes = $("notes");
    for (const n of D.notes) notes.append(el("li", { text: n }));
    if (D.exact_note) notes.append(el("li", { text: D.exact_note }));
  }

  // ---------- tokens ----------
  let tokenSpans = [];
  function renderTokens() {
    const box = $("tokens");
    box.textContent = "";
    tokenSpans = D.tokens.map((t, i) => {
      const isSpecial = SPECIAL_FLAGS ? SPECIAL_FLAGS[i] : SPECIAL.test(t);
      const s = el("span", { class: "tok" + (isSpecial ? " special" : ""), "data-i": i, title: `#${i}` }, t);
      s.addEventListener("click", () => selectToken(i));
      box.append(s);
      return s;
    });
  }
  function shadeTokens() {
    const w = headWeights(S.layer, S.head), s = S.token;
    const vals = new Float32Array(T);
    if (w) {
      for (let j = 0; j < T; j++) vals[j] = S.dir === "out" ? w[s * T + j] : w[j * T + s];
    } else if (TOPK && S.dir === "out") {
      // no matrix for this head: its heaviest keys for the selected query
      const [idx, wt] = topKeys(S.layer, S.head, s);
      idx.forEach((j, n) => { if (j >= 0) vals[j] = wt[n]; });
    }
    let mx = 0;
    for (let j = 0; j < T; j++) mx = Math.max(mx, vals[j]);
    for (let j = 0; j < T; j++) {
      const t = mx > 0 ? vals[j] / mx : 0;
      const ci = Math.round(Math.sqrt(t) * 255 * 0.92);
      const span = tokenSpans[j];
      span.style.background = rgb(ci);
      span.style.color = TEXT_ON[ci];
      span.dataset.shade = t.toFixed(4);
      span.dataset.weight = String(vals[j]);
      span.title = (S.dir === "out" ? tx("#{j} · weight from “{token}”: {weight}", { j, token: D.tokens[s], weight: fmt(vals[j]) })
        : tx("#{j} · weight to “{token}”: {weight}", { j, token: D.tokens[s], weight: fmt(vals[j]) }));
      span.classList.toggle("sel", j === s);
    }
    $("tokens-hint").textContent = !w && !(TOPK && S.dir === "out")
      ? tx("no matrix stored for layer {layer} · head {head} (long input): nothing to shade", { layer: S.layer, head: S.head })
      : S.dir === "out"
      ? tx("shade: how much “{token}” (#{s}) attends to each token (√, relative to its largest weight)", { token: D.tokens[s], s }) + (w ? "" : tx("; its {k} heaviest keys only", { k: TOPK.k }))
      : tx("shade: how much each token attends to “{token}” (#{s}) (√, relative to the largest)", { token: D.tokens[s], s });
  }
  function topKeys(l, h, i) {
    const k = TOPK.k, off = ((l * H + h) * T + i) * k;
    return [Array.from(TOPK.indices.subarray(off, off + k)), Array.from(TOPK.weights.subarray(off, off + k))];
  }

  // ---------- head grid ----------
  let thumbs = [];
  function renderGrid() {
    const grid = $("head-grid");
    grid.textContent = "";
    grid.style.gridTemplateColumns = `28px repeat(${H}, minmax(20px, 52px))`;
    grid.append(el("span"));
    for (let h = 0; h < H; h++) grid.append(el("span", { class: "lab", text: "H" + h }));
    thumbs = [];
    for (let l = 0; l < L; l++) {
      grid.append(el("span", { class: "lab", text: "L" + l }));
      for (let h = 0; h < H; h++) {
        const R = Math.min(T, 64);
        const c = el("canvas", { class: "thumb", width: R, height: R, "data-layer": l, "data-head": h });
        const st = D.stats;
        c.title = tx("layer {layer} · head {head}", { layer: l, head: h }) + "\n" +
          tx("entropy {entropy} bits · self {self} · first {first} · last {last}",
            { entropy: fmt(st.entropy[l][h], 3), self: pct(st.self[l][h]), first: pct(st.first[l][h]), last: pct(st.last[l][h]) }) +
          (exact[key(l, h)] ? "\n" + tx("exact values stored") : "") +
          (u8Offset(l, h) < 0 ? "\n" + tx("no matrix stored (long input): statistics and heaviest keys only") : "");
        c.addEventListener("click", () => selectHead(l, h));
        if (exact[key(l, h)] && Object.keys(exact).length < L * H) c.classList.add("exact");
        grid.append(c);
        thumbs.push(c);
      }
    }
    const nExact = Object.keys(exact).length;
    if (VIEW) { $("grid-note").textContent = VIEW.note; drawThumbs(); return; }
    $("grid-note").textContent = (T > 64 ? tx("Thumbnails show the largest weight in each block of {n}×{n} cells.", { n: Math.ceil(T / 64) }) + " " : "") +
      (U8_INDEX ? tx("The input is long: only {n} heads have a matrix; the grey ones have statistics and each query's heaviest keys.", { n: Object.keys(U8_INDEX).length }) + " " : "") +
      (nExact < L * H ? tx("Exact values and traces stored for {n} of {total} heads (underlined in blue: {heads}); the others show 8-bit values.",
        { n: nExact, total: L * H, heads: Object.keys(exact).map((k) => "L" + k.replace(".", "·H")).join(", ") }) : tx("Exact values stored for every head."));
    drawThumbs();
  }
  // thumbnails come straight from the 8-bit data (q = round(255·√w)): max-pool q over blocks, then map
  // q to the colour index of the current scale
  const LIN = new Uint8Array(256);
  for (let q = 0; q < 256; q++) LIN[q] = Math.round(255 * APPROX[q]);
  function drawThumbs() {
    for (const c of thumbs) {
      const l = +c.dataset.layer, h = +c.dataset.head, R = c.width, off = u8Offset(l, h);
      const ctx = c.getContext("2d");
      c.classList.toggle("sel", l === S.layer && h === S.head);
      if (off < 0) { ctx.fillStyle = "#e4e7ee"; ctx.fillRect(0, 0, R, R); c.classList.add("nomatrix"); continue; }
      const img = ctx.createImageData(R, R), px = img.data;
      let rowQ = null;
      if (S.scale === "row") {
        rowQ = new Uint8Array(T);
        for (let i = 0; i < T; i++) { let m = 0; const b = off + i * T; for (let j = 0; j < T; j++) if (U8[b + j] > m) m = U8[b + j]; rowQ[i] = m; }
      }
      for (let a = 0; a < R; a++) {
        const i0 = Math.floor(a * T / R), i1 = Math.max(i0 + 1, Math.floor((a + 1) * T / R));
        for (let b = 0; b < R; b++) {
          const j0 = Math.floor(b * T / R), j1 = Math.max(j0 + 1, Math.floor((b + 1) * T / R));
          let best = 0;
          for (let i = i0; i < i1; i++) {
            const base = off + i * T;
            if (rowQ) {
              const m = rowQ[i] || 1;
              for (let j = j0; j < j1; j++) { const ci = Math.round(255 * (U8[base + j] / m) ** 2); if (ci > best) best = ci; }
            } else {
              for (let j = j0; j < j1; j++) if (U8[base + j] > best) best = U8[base + j];
            }
          }
          if (S.scale === "linear") best = LIN[best];
          const o = 4 * (a * R + b);
          px[o] = LUT[3 * best]; px[o + 1] = LUT[3 * best + 1]; px[o + 2] = LUT[3 * best + 2]; px[o + 3] = 255;
        }
      }
      ctx.putImageData(img, 0, 0);
      c.classList.toggle("sel", l === S.layer && h === S.head);
    }
  }

  // ---------- big heatmap ----------
  const geo = { size: 0, left: 0, top: 0, cell: 1, labels: false };
  let cellImage = null;
  function layoutHeat() {
    const wrap = $("heat-wrap"), dpr = window.devicePixelRatio || 1;
    const size = Math.max(200, Math.round(wrap.clientWidth || 600));
    geo.size = size;
    const ctx0 = $("heatmap").getContext("2d");
    ctx0.font = (T <= 24 ? "14px " : "11px ") + getComputedStyle(document.body).fontFamily;
    let lab = 0;
    for (const t of D.tokens) lab = Math.max(lab, ctx0.measureText(t).width);
    const margin0 = Math.min(120, Math.ceil(lab) + 12);
    const cellIfLabels = (size - margin0 - 4) / T;
    geo.labels = cellIfLabels >= 11;
    const m = geo.labels ? margin0 : 34;
    geo.left = m; geo.top = m;
    geo.cell = (size - m - 4) / T;
    for (const id of ["heatmap", "overlay"]) {
      const c = $(id);
      c.width = Math.round(size * dpr); c.height = Math.round(size * dpr);
      c.getContext("2d").setTransform(dpr, 0, 0, dpr, 0, 0);
    }
  }
  function drawHeat() {
    const w = headWeights(S.layer, S.head);
    if (!w) { drawNoMatrix(); return; }
    const rm = rowMaxes(w);
    const off = document.createElement("canvas");
    off.width = T; off.height = T;
    const octx = off.getContext("2d"), img = octx.createImageData(T, T), px = img.data;
    for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
      const ci = colourIndex(w[i * T + j], rm[i]), o = 4 * (i * T + j);
      px[o] = LUT[3 * ci]; px[o + 1] = LUT[3 * ci + 1]; px[o + 2] = LUT[3 * ci + 2]; px[o + 3] = 255;
    }
    octx.putImageData(img, 0, 0);
    cellImage = off;
    const c = $("heatmap"), ctx = c.getContext("2d");
    ctx.clearRect(0, 0, geo.size, geo.size);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, geo.left, geo.top, geo.cell * T, geo.cell * T);
    ctx.strokeStyle = "#d0d5dd"; ctx.lineWidth = 1;
    ctx.strokeRect(geo.left - 0.5, geo.top - 0.5, geo.cell * T + 1, geo.cell * T + 1);
    const fontPx = Math.max(11, Math.min(14, Math.floor(geo.cell * 0.4)));
    const family = getComputedStyle(document.body).fontFamily;
    ctx.fillStyle = "#475467";
    ctx.font = fontPx + "px " + family;
    if (geo.cell >= 40) {
      // big cells: write each weight in its cell
      ctx.textAlign = "center"; ctx.textBaseline = "middle";
      ctx.font = "600 " + Math.max(10, Math.min(15, Math.floor(geo.cell / 4.5))) + "px " + family;
      const digits = geo.cell >= 64 ? 4 : 2;
      for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
        const v = w[i * T + j], ci = colourIndex(v, rm[i]);
        ctx.fillStyle = TEXT_ON[ci];
        ctx.fillText((exact[key(S.layer, S.head)] ? "" : "≈") + v.toFixed(digits), geo.left + (j + 0.5) * geo.cell, geo.top + (i + 0.5) * geo.cell);
      }
      ctx.fillStyle = "#475467";
      ctx.font = fontPx + "px " + family;
    }
    if (geo.labels) {
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      for (let i = 0; i < T; i++) ctx.fillText(D.tokens[i], geo.left - 6, geo.top + (i + 0.5) * geo.cell);
      let widest = 0;
      for (const t of D.tokens) widest = Math.max(widest, ctx.measureText(t).width);
      const dpr = window.devicePixelRatio || 1;
      ctx.save();
      for (let j = 0; j < T; j++) {
        ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
        geo.horizontal = widest <= geo.cell - 6;
        if (geo.horizontal) {
          ctx.textAlign = "center"; ctx.textBaseline = "bottom";
          ctx.fillText(D.tokens[j], geo.left + (j + 0.5) * geo.cell, geo.top - 6);
        } else {
          ctx.translate(geo.left + (j + 0.5) * geo.cell, geo.top - 6);
          ctx.rotate(-Math.PI / 2);
          ctx.textAlign = "left"; ctx.textBaseline = "middle";
          ctx.fillText(D.tokens[j], 0, 0);
        }
      }
      ctx.restore();
    } else {
      const step = niceStep(T);
      ctx.textBaseline = "middle";
      for (let i = 0; i <= T - 1; i += step) {
        ctx.textAlign = "right";
        ctx.fillText(String(i), geo.left - 5, geo.top + (i + 0.5) * geo.cell);
        ctx.textAlign = "center";
        ctx.fillText(String(i), geo.left + (i + 0.5) * geo.cell, geo.top - 10);
      }
      ctx.textAlign = "left";
      ctx.fillText(tx("key →"), geo.left + geo.cell * T - 34, geo.top - 24 < 2 ? 8 : geo.top - 24);
    }
    drawOverlay();
  }
  function drawNoMatrix() {
    cellImage = null;
    const c = $("heatmap"), ctx = c.getContext("2d");
    ctx.clearRect(0, 0, geo.size, geo.size);
    ctx.fillStyle = "#f6f7fb";
    ctx.fillRect(geo.left, geo.top, geo.cell * T, geo.cell * T);
    ctx.fillStyle = "#475467"; ctx.textAlign = "center"; ctx.textBaseline = "middle";
    ctx.font = "14px " + getComputedStyle(document.body).fontFamily;
    const x = geo.left + geo.cell * T / 2, y = geo.top + geo.cell * T / 2;
    ctx.fillText(tx("No matrix is stored for layer {layer} · head {head}: the input is long.", { layer: S.layer, head: S.head }), x, y - 12);
    ctx.fillText(tx("Pick a head with a coloured thumbnail, or: selfattention report … --head {layer}.{head}", { layer: S.layer, head: S.head }), x, y + 12);
    $("overlay").getContext("2d").clearRect(0, 0, geo.size, geo.size);
  }
  function niceStep(n) {
    for (const s of [1, 2, 5, 10, 20, 25, 50, 100, 128, 200, 256]) if (n / s <= 8) return s;
    return 500;
  }
  function drawOverlay() {
    const c = $("overlay"), ctx = c.getContext("2d"), s = S.token, g = geo;
    ctx.clearRect(0, 0, g.size, g.size);
    if (!headWeights(S.layer, S.head)) return;
    const x0 = g.left, y0 = g.top, n = g.cell * T, cs = g.cell;
    // veil everything except the selected row (what the token attends to) and column (what attends to it);
    // not when the cells hold their numbers (cell ≥ 40 px): a veil would fade them to grey
    if (cs >= 4 && cs < 40) {
      ctx.fillStyle = "rgba(255,255,255,0.6)";
      ctx.fillRect(x0, y0, n, n);
      ctx.clearRect(x0, y0 + s * cs, n, cs);     // row band
      ctx.clearRect(x0 + s * cs, y0, cs, n);     // column band
    }
    // outline the two bands (at least 3 px wide, so a 1-px row stays visible at 512 tokens)
    const band = Math.max(cs, 3), rs = y0 + (s + 0.5) * cs - band / 2, cl = x0 + (s + 0.5) * cs - band / 2;
    ctx.lineWidth = Math.max(1.5, Math.min(2.5, cs / 3));
    ctx.strokeStyle = "#e8572a";
    const pad = Math.max(1, ctx.lineWidth / 2);
    const rowBox = () => ctx.strokeRect(x0 - pad, rs - pad, n + 2 * pad, band + 2 * pad);
    const colBox = () => ctx.strokeRect(cl - pad, y0 - pad, band + 2 * pad, n + 2 * pad);
    if (S.dir === "out") { rowBox(); ctx.setLineDash([4, 3]); colBox(); } else { colBox(); ctx.setLineDash([4, 3]); rowBox(); }
    ctx.setLineDash([]);
    if (g.labels) {
      // the selected token's two axis labels, in the accent colour
      const fam = getComputedStyle(document.body).fontFamily, fontPx = Math.max(11, Math.min(14, Math.floor(cs * 0.4)));
      ctx.font = "700 " + fontPx + "px " + fam;
      const label = D.tokens[s], tw = ctx.measureText(label).width;
      ctx.fillStyle = "#fff";
      ctx.fillRect(x0 - 8 - tw - 3, y0 + (s + 0.5) * cs - fontPx / 2 - 3, tw + 6, fontPx + 6);
      ctx.fillStyle = "#e8572a"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
      ctx.fillText(label, x0 - 6, y0 + (s + 0.5) * cs);
      ctx.save();
      ctx.translate(x0 + (s + 0.5) * cs, y0 - 6);
      if (g.horizontal) {
        ctx.fillStyle = "#fff"; ctx.fillRect(-tw / 2 - 3, -fontPx - 3, tw + 6, fontPx + 5);
        ctx.fillStyle = "#e8572a"; ctx.textAlign = "center"; ctx.textBaseline = "bottom"; ctx.fillText(label, 0, 0);
      } else {
        ctx.rotate(-Math.PI / 2);
        ctx.fillStyle = "#fff"; ctx.fillRect(-3, -fontPx / 2 - 3, tw + 6, fontPx + 6);
        ctx.fillStyle = "#e8572a"; ctx.textAlign = "left"; ctx.textBaseline = "middle"; ctx.fillText(label, 0, 0);
      }
      ctx.restore();
    } else {
      // triangles in the margins point at the selected row and column
      ctx.fillStyle = "#e8572a";
      const yc = y0 + (s + 0.5) * cs, xc = x0 + (s + 0.5) * cs;
      ctx.beginPath(); ctx.moveTo(x0 - 3, yc); ctx.lineTo(x0 - 10, yc - 5); ctx.lineTo(x0 - 10, yc + 5); ctx.fill();
      ctx.beginPath(); ctx.moveTo(xc, y0 - 3); ctx.lineTo(xc - 5, y0 - 10); ctx.lineTo(xc + 5, y0 - 10); ctx.fill();
    }
    if (S.hover) {
      const [i, j] = S.hover;
      ctx.lineWidth = 1.5; ctx.strokeStyle = "#101828";
      ctx.strokeRect(x0 + j * cs - 1, y0 + i * cs - 1, cs + 2, cs + 2);
    }
    c.dataset.row = String(s);
    c.dataset.col = String(s);
    // geometry in CSS pixels of the canvas, for tools and tests: cell (i, j) spans
    // [left + j·cell, left + (j+1)·cell) × [top + i·cell, top + (i+1)·cell)
    c.dataset.left = String(g.left);
    c.dataset.top = String(g.top);
    c.dataset.cell = String(g.cell);
    c.dataset.size = String(g.size);
  }
  function cellAt(ev) {
    const r = $("overlay").getBoundingClientRect();
    const x = (ev.clientX - r.left) * (geo.size / r.width), y = (ev.clientY - r.top) * (geo.size / r.height);
    const j = Math.floor((x - geo.left) / geo.cell), i = Math.floor((y - geo.top) / geo.cell);
    if (i < 0 || j < 0 || i >= T || j >= T) return null;
    return [i, j, ev.clientX - r.left, ev.clientY - r.top, r.width];
  }
  function onHover(ev) {
    const hit = cellAt(ev), tip = $("tooltip");
    if (!hit) { tip.hidden = true; S.hover = null; drawOverlay(); return; }
    const [i, j, px, py, width] = hit;
    if (!S.hover || S.hover[0] !== i || S.hover[1] !== j) {
      S.hover = [i, j];
      drawOverlay();
      const e = exact[key(S.layer, S.head)];
      const hw = headWeights(S.layer, S.head);
      if (!hw) { tip.hidden = true; return; }
      const w = hw[i * T + j];
      tip.textContent = "";
      tip.append(
        el("div", null, tx("query") + " ", el("span", { class: "t", text: D.tokens[i] }), ` #${i} → ${tx("key")} `, el("span", { class: "t", text: D.tokens[j] }), ` #${j}`),
        e ? el("div", null, tx("weight") + " ", el("span", { class: "w", text: w.toPrecision(6) }))
          : el("div", null, tx("weight") + " ≈ ", el("span", { class: "w", text: fmt(w, 3) }), el("span", { class: "sub", text: "  " + tx("(8-bit; exact not stored)") })),
        e ? el("div", { class: "sub", text: tx("score {score} · scaled {scaled}", { score: fmt(e.scores[i * T + j]), scaled: fmt(e.scaled[i * T + j]) }) }) : null,
      );
      tip.dataset.query = String(i);
      tip.dataset.key = String(j);
      tip.dataset.weight = String(w);
      tip.dataset.exact = e ? "1" : "0";
    }
    tip.hidden = false;
    const tw = tip.offsetWidth;
    tip.style.left = Math.min(px + 14, width - tw - 4) + "px";
    tip.style.top = (py + 16) + "px";
  }

  // ---------- legend ----------
  function drawLegend() {
    const c = $("legend"), w = Math.max(100, c.clientWidth || 600);
    c.width = w; c.height = 12;
    const ctx = c.getContext("2d");
    for (let x = 0; x < w; x++) { ctx.fillStyle = rgb(Math.round((x / (w - 1)) * 255)); ctx.fillRect(x, 0, 1, 12); }
    const ticks = $("legend-ticks");
    ticks.textContent = "";
    const vals = S.scale === "sqrt" ? [0, 0.01, 0.05, 0.1, 0.25, 0.5, 1] : S.scale === "linear" ? [0, 0.25, 0.5, 0.75, 1] : null;
    if (vals) {
      for (const v of vals) {
        const pos = S.scale === "sqrt" ? Math.sqrt(v) : v;
        ticks.append(el("span", { style: `left:${(pos * 100).toFixed(2)}%`, text: String(v) }));
      }
    } else {
      ticks.append(el("span", { style: "left:0;transform:none", text: "0" }), el("span", { style: "left:auto;right:0;transform:none", text: tx("each row's largest weight") }));
    }
  }

  // ---------- head stats line ----------
  function renderHeadStats() {
    const st = D.stats, l = S.layer, h = S.head;
    $("heat-title").textContent = L * H > 1 ? tx("Layer {layer} · head {head}", { layer: l, head: h }) : tx("Attention weights");
    const box = $("head-stats");
    box.textContent = "";
    const first = D.tokens[0], last = D.tokens[T - 1];
    const items = [
      [tx("entropy"), tx("{bits} bits", { bits: fmt(st.entropy[l][h], 3) }), tx("of at most {bits} (uniform)", { bits: fmt(Math.log2(T), 3) })],
      [tx("on self"), pct(st.self[l][h])],
      [tx("on first “{token}”", { token: first }), pct(st.first[l][h])],
      [tx("on last “{token}”", { token: last }), pct(st.last[l][h])],
    ];
    if (VIEW) {
      // the statistics are those of the raw token weights: in another view say what is shown instead
      box.append(el("span", { class: "muted", text: VIEW.note }));
      return;
    }
    for (const [k, v, extra] of items) box.append(el("span", null, k + " ", el("b", { text: v }), extra ? el("span", { class: "muted", text: " " + extra }) : null));
  }

  // ---------- statistics table ----------
  const METRIC_NOTE = {
    entropy: "Mean over query rows of −Σ w log₂ w, in bits. Low: each token looks at a few tokens; log₂ T: uniform.",
    self: "Mean over query rows of the weight a token gives itself (the diagonal).",
    first: "Mean over query rows of the weight on the first token. Heads that park most weight here (often [CLS]) act as a no-op.",
    last: "Mean over query rows of the weight on the last token ([SEP] for the model), another common ‘sink’.",
    // translated where shown (tx(METRIC_NOTE[...])); the texts are listed in selfattention/report/labels.py
  };
  function renderStats() {
    const box = $("stats"), st = D.stats[S.metric];
    box.textContent = "";
    let lo = Infinity, hi = -Infinity;
    for (const r of st) for (const v of r) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    const tbl = el("table", { class: "stats" });
    tbl.append(el("tr", null, el("th"), Array.from({ length: H }, (_, h) => el("th", { text: "H" + h }))));
    for (let l = 0; l < L; l++) {
      const tr = el("tr", null, el("th", { text: "L" + l }));
      for (let h = 0; h < H; h++) {
        const v = st[l][h], t = hi > lo ? (v - lo) / (hi - lo) : 0.5, ci = Math.round(t * 220);
        const td = el("td", {
          class: l === S.layer && h === S.head ? "sel" : null,
          style: `background:${rgb(ci)};color:${TEXT_ON[ci]}`,
          title: tx("layer {layer} · head {head}", { layer: l, head: h }),
          text: S.metric === "entropy" ? v.toFixed(2) : (100 * v).toFixed(1),
        });
        td.addEventListener("click", () => selectHead(l, h));
        tr.append(td);
      }
      tbl.append(tr);
    }
    box.append(el("div", { class: "stats-wrap" }, tbl));
    $("metric-note").textContent = tx(METRIC_NOTE[S.metric]) + (S.metric === "entropy" ? "" : " " + tx("Shown in %."));
  }

  // ---------- trace ----------
  function matTable(title, arr, rows, cols, rowLabels, colLabels, selRow) {
    const tbl = el("table", { class: "num mat" }, el("caption", { text: title }));
    tbl.append(el("tr", null, el("th"), colLabels.map((c) => el("th", { text: c }))));
    for (let i = 0; i < rows; i++) {
      const tr = el("tr", { class: i === selRow ? "sel" : null }, el("th", { class: "rl", text: rowLabels[i] }));
      for (let j = 0; j < cols; j++) tr.append(el("td", { text: fmt(arr[i * cols + j], 4) }));
      tbl.append(tr);
    }
    return tbl;
  }
  function renderTrace() {
    const box = $("trace"), l = S.layer, h = S.head, s = S.token, e = exact[key(l, h)];
    box.textContent = "";
    $("trace-hint").textContent = tx("layer {layer} · head {head} · query “{token}” (#{s})", { layer: l, head: h, token: D.tokens[s], s });
    if (VIEW) {
      box.append(el("div", { class: "missing", text: tx("The trace is that of the raw weights over tokens: choose “raw” and “by token” above the heatmap to see it.") }));
      return;
    }
    if (!e) {
      const links = Object.keys(exact).map((k) => {
        const [kl, kh] = k.split(".").map(Number);
        return el("button", { class: "btn", type: "button", "data-goto": k, onclick: () => selectHead(kl, kh), text: `L${kl}·H${kh}` });
      });
      box.append(el("div", { class: "missing" },
        tx("The trace of layer {layer} · head {head} is not stored in this file; exact values are kept for", { layer: l, head: h }) + " ",
        links.flatMap((b, n) => (n ? [" ", b] : [b])),
        ". " + tx("Select one of those heads, or make a report for this head:") + " ",
        el("code", { text: `selfattention report … --head ${l}.${h}` }), "."));
      if (TOPK) {
        const [idx, wt] = topKeys(l, h, s);
        box.append(el("p", { class: "small", text: tx("Heaviest keys of query “{token}” (#{s}) in this head (from the tiled statistics):", { token: D.tokens[s], s }) }),
          el("div", { class: "chips" }, idx.map((j, n) => j < 0 ? null : el("span", { "data-key": j }, el("i", { text: "#" + j }), `${D.tokens[j]} ${fmt(wt[n], 4)}`))));
      }
      return;
    }
    const dk = e.query ? e.query.shape[1] : D.head_dim, dv = e.context.shape[1];
    box.append(el("div", { class: "formula", text:
      tx("scores = Q Kᵀ   →   scaled = scores × {scale}   →   weights = softmax over each row   →   context = weights · V",
        { scale: fmt(e.scale, 6) + (e.scale === 1 ? "" : " (1/√" + dk + ")") }) }));
    if (T <= 12) {
      const tok = D.tokens, dl = (n) => Array.from({ length: n }, (_, i) => "d" + i);
      const mats = el("div", { class: "mats" });
      if (e.query) {
        mats.append(matTable(tx("Q (query)"), e.query, T, dk, tok, dl(dk), s));
        mats.append(matTable(tx("K (key)"), e.key, T, dk, tok, dl(dk), s));
        mats.append(matTable(tx("V (value)"), e.value, T, e.value.shape[1], tok, dl(e.value.shape[1]), s));
      }
      mats.append(matTable(tx("1 · scores Q Kᵀ"), e.scores, T, T, tok, tok, s));
      mats.append(matTable(tx("2 · scaled × {scale}", { scale: fmt(e.scale, 4) }), e.scaled, T, T, tok, tok, s));
      mats.append(matTable(tx("3 · weights softmax"), e.weights, T, T, tok, tok, s));
      mats.append(matTable(tx("4 · context weights · V"), e.context, T, dv, tok, dl(dv), s));
      box.append(mats);
    }
    // one query's row of the trace, key by key
    const order = Array.from({ length: T }, (_, j) => j);
    const wrow = (j) => e.weights[s * T + j];
    if (S.sortByWeight) order.sort((a, b) => wrow(b) - wrow(a) || a - b);
    const limit = S.showAll || T <= 40 ? T : 24;
    const shown = S.sortByWeight || limit === T ? order.slice(0, limit) : windowAround(s, limit);
    let mx = 0, sum = 0;
    for (let j = 0; j < T; j++) { mx = Math.max(mx, wrow(j)); sum += wrow(j); }
    const bar = el("div", { class: "toolbar" },
      el("span", { class: "small muted", text: tx("Row {s} of the trace: query “{token}” against every key.", { s, token: D.tokens[s] }) }),
      el("button", { class: "btn", type: "button", onclick: () => { S.sortByWeight = !S.sortByWeight; renderTrace(); },
        text: S.sortByWeight ? tx("order by position") : tx("order by weight") }),
      T > 40 ? el("button", { class: "btn", type: "button", onclick: () => { S.showAll = !S.showAll; renderTrace(); },
        text: S.showAll ? tx("show {n} keys", { n: 24 }) : tx("show all {n} keys", { n: T }) }) : null);
    const tbl = el("table", { class: "num" });
    tbl.append(el("tr", null, ["#", tx("key")].map((x) => el("th", { class: "rl", text: x })),
      [tx("score qᵢ·kⱼ"), tx("scaled ×{scale}", { scale: fmt(e.scale, 4) }), tx("weight"), ""].map((x) => el("th", { text: x }))));
    for (const j of shown) {
      const wj = wrow(j);
      tbl.append(el("tr", { class: j === s ? "sel" : null, "data-key": j },
        el("th", { class: "rl", text: String(j) }),
        el("th", { class: "rl", text: D.tokens[j] }),
        el("td", { text: fmt(e.scores[s * T + j]) }),
        el("td", { text: fmt(e.scaled[s * T + j]) }),
        el("td", { class: wj === mx ? "hot" : null, text: fmt(wj) }),
        el("td", { class: "barcell" }, el("span", { class: "bar", style: `width:${mx > 0 ? (100 * wj / mx).toFixed(1) : 0}px` }))));
    }
    const left = el("div", null, bar, el("div", { class: "scroll" }, tbl),
      el("p", { class: "small muted", text: tx("Σ weights over all {n} keys = {sum}", { n: T, sum: sum.toFixed(6) }) + (limit < T ? " · " + tx("showing {shown} of {n} keys", { shown: shown.length, n: T }) : "") }));
    const ctx = el("div", { class: "ctx" },
      el("div", { class: "small", style: "font-weight:600;margin-bottom:6px", text: tx("Context vector z{s} = Σⱼ weightⱼ · vⱼ  ({n} numbers)", { s: sub(s), n: dv }) }),
      el("div", { class: "chips" }, Array.from({ length: dv }, (_, d) => el("span", null, el("i", { text: "d" + d }), fmt(e.context[s * dv + d], 4)))));
    box.append(el("div", { class: "row-trace" }, left, ctx));
  }
  function windowAround(s, n) {
    let a = Math.max(0, s - Math.floor(n / 2));
    const b = Math.min(T, a + n);
    a = Math.max(0, b - n);
    return Array.from({ length: b - a }, (_, k) => a + k);
  }
  function sub(n) { return String(n).split("").map((c) => "₀₁₂₃₄₅₆₇₈₉"[+c]).join(""); }

  // ---------- selection ----------
  function syncSeg(id, attr, value) {
    for (const b of $(id).querySelectorAll("button")) b.classList.toggle("on", b.dataset[attr] === value);
  }
  function publish() {
    app.dataset.layer = String(S.layer);
    app.dataset.head = String(S.head);
    app.dataset.token = String(S.token);
    app.dataset.dir = S.dir;
    app.dataset.scale = S.scale;
    app.dataset.view = S.unit + ":" + S.measure;
  }
  function selectToken(i) {
    S.token = Math.max(0, Math.min(T - 1, i));
    shadeTokens(); drawOverlay(); renderTrace(); publish();
    // keep the selected token visible inside the (scrolling) token box, without scrolling the page
    const box = $("tokens"), span = tokenSpans[S.token];
    if (span.offsetTop < box.scrollTop || span.offsetTop + span.offsetHeight > box.scrollTop + box.clientHeight) {
      box.scrollTop = span.offsetTop - box.clientHeight / 2;
    }
  }
  function selectHead(l, h) {
    S.layer = l; S.head = h;
    for (const c of thumbs) c.classList.toggle("sel", +c.dataset.layer === l && +c.dataset.head === h);
    renderHeadStats(); drawHeat(); shadeTokens(); renderTrace(); renderStats(); publish();
  }

  // ---------- views: words, rollout, flow, ‖α f(x)‖ ----------
  function viewName(unit, measure) { return unit + ":" + measure; }
  function hasView(name) { return name === "tokens:raw" || Boolean(D.views && D.views[name]); }
  function syncViewButtons() {
    for (const b of $("measure-toggle").querySelectorAll("button")) b.disabled = !hasView(viewName(S.unit, b.dataset.measure));
    for (const b of $("unit-toggle").querySelectorAll("button")) b.disabled = !hasView(viewName(b.dataset.unit, S.measure));
    syncSeg("measure-toggle", "measure", S.measure); syncSeg("unit-toggle", "unit", S.unit);
  }
  // the selected token's index in another unit: a token's word, or a word's first token
  function mapToken(i, from, to) {
    if (from === to) return i;
    const groups = (D.views[viewName("words", "raw")] || {}).groups;
    if (!groups) return 0;
    if (to === "words") return Math.max(0, groups.findIndex((g) => g.includes(i)));
    return groups[i] ? groups[i][0] : 0;
  }
  async function applyView(unit, measure) {
    const name = viewName(unit, measure);
    if (!hasView(name)) return;
    S.token = mapToken(S.token, S.unit, unit);
    S.unit = unit; S.measure = measure;
    if (name === "tokens:raw") {
      VIEW = null;
      ({ tokens: D.tokens, T, U8, U8_INDEX, TOPK, SPECIAL_FLAGS, exact } = BASE);
    } else {
      const v = D.views[name];
      if (!v.u8) v.u8 = await decode(v.weights_u8);
      VIEW = v;
      D.tokens = v.labels; T = v.labels.length; U8 = v.u8; U8_INDEX = null; TOPK = null; SPECIAL_FLAGS = v.special; exact = {};
    }
    for (const k of Object.keys(approxCache)) delete approxCache[k];
    S.token = Math.max(0, Math.min(T - 1, S.token)); S.hover = null;
    renderTokens();
    if (L * H > 1) renderGrid();
    layoutHeat(); renderHeadStats(); drawHeat(); shadeTokens(); renderTrace(); syncViewButtons(); publish();
  }

  async function loadFonts() {
    // the embedded glyph subset of a CJK font (a data: URL) must be loaded before the canvases draw labels
    if (!document.fonts || !document.fonts.load) return;
    const text = D.tokens.join("") + (D.title || "") + (D.caveat_zh || "") + (D.title_glyphs || "");
    try { await document.fonts.load('14px "selfattention CJK"', text); } catch (e) { console.warn(e); }
  }

  async function main() {
    // the overlay is small and read back by tools and tests (pixel checks of the highlight)
    $("overlay").getContext("2d", { willReadFrequently: true });
    D = JSON.parse($("report-data").textContent);
    translatePage(D.labels, D.lang);
    T = D.n_tokens; L = D.n_layers; H = D.n_heads;
    S.layer = D.initial.layer; S.head = D.initial.head; S.token = D.initial.token;
    renderHeader();
    U8 = await decode(D.weights_u8);
    if (D.u8_heads) U8_INDEX = Object.fromEntries(D.u8_heads.map((k, i) => [k, i]));
    if (D.special) SPECIAL_FLAGS = D.special;
    if (D.topk) {
      const idx = await decode(D.topk.indices), wt = await decode(D.topk.weights);
      TOPK = { indices: idx, weights: wt, k: idx.shape[3] };
    }
    const entries = Object.entries(D.exact);
    await Promise.all(entries.map(async ([k, rec]) => {
      const out = { scale: rec.scale };
      for (const name of ["scores", "scaled", "weights", "context", "query", "key", "value"]) if (rec[name]) out[name] = await decode(rec[name]);
      exact[k] = out;
    }));
    BASE = { tokens: D.tokens, T, U8, U8_INDEX, TOPK, SPECIAL_FLAGS, exact };
    const hasViews = Boolean(D.views && Object.keys(D.views).length);
    $("measure-toggle").hidden = !hasViews; $("unit-toggle").hidden = !hasViews;
    if (hasViews) {
      // every label of every view is drawn with the embedded CJK glyphs too
      for (const v of Object.values(D.views)) D.title_glyphs = (D.title_glyphs || "") + v.labels.join("");
    }
    await loadFonts();
    const tDecode = performance.now();
    if (L * H === 1) $("left-col").hidden = true;
    renderTokens();
    if (L * H > 1) renderGrid();
    layoutHeat();
    drawLegend();
    renderHeadStats();
    drawHeat();
    shadeTokens();
    renderTrace();
    if (L * H > 1) renderStats();
    syncSeg("dir-toggle", "dir", S.dir); syncSeg("scale-toggle", "scale", S.scale); syncSeg("metric-toggle", "metric", S.metric);
    publish();
    if (hasViews) {
      syncViewButtons();
      const [u0, m0] = (D.initial.view || "tokens:raw").split(":");
      if (u0 !== "tokens" || m0 !== "raw") {
        // the initial token is given in the initial view's unit
        const t0 = D.initial.token; await applyView(u0, m0); S.token = Math.min(T - 1, t0); selectToken(S.token);
      }
      $("measure-toggle").addEventListener("click", (ev) => {
        const b = ev.target.closest("button"); if (!b || b.disabled) return;
        applyView(S.unit, b.dataset.measure).catch((e) => showError(String(e && e.stack || e)));
      });
      $("unit-toggle").addEventListener("click", (ev) => {
        const b = ev.target.closest("button"); if (!b || b.disabled) return;
        applyView(b.dataset.unit, S.measure).catch((e) => showError(String(e && e.stack || e)));
      });
    }

    const ov = $("overlay");
    ov.addEventListener("mousemove", onHover);
    ov.addEventListener("mouseleave", () => { $("tooltip").hidden = true; S.hover = null; drawOverlay(); });
    ov.addEventListener("click", (ev) => { const hit = cellAt(ev); if (hit) selectToken(hit[0]); });
    $("dir-toggle").addEventListener("click", (ev) => {
      const b = ev.target.closest("button"); if (!b) return;
      S.dir = b.dataset.dir; syncSeg("dir-toggle", "dir", S.dir); shadeTokens(); drawOverlay(); publish();
    });
    $("scale-toggle").addEventListener("click", (ev) => {
      const b = ev.target.closest("button"); if (!b) return;
      S.scale = b.dataset.scale; syncSeg("scale-toggle", "scale", S.scale); drawLegend(); drawHeat(); if (thumbs.length) drawThumbs(); publish();
    });
    $("metric-toggle").addEventListener("click", (ev) => {
      const b = ev.target.closest("button"); if (!b) return;
      S.metric = b.dataset.metric; syncSeg("metric-toggle", "metric", S.metric); renderStats();
    });
    document.addEventListener("keydown", (ev) => {
      if (ev.target.closest && ev.target.closest("input, textarea")) return;
      if (ev.key === "ArrowRight") { selectToken(S.token + 1); ev.preventDefault(); }
      if (ev.key === "ArrowLeft") { selectToken(S.token - 1); ev.preventDefault(); }
    });
    let resizeTimer = 0;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { layoutHeat(); drawHeat(); drawLegend(); }, 120);
    });
    const tDone = performance.now();
    window.__report = { decodeMs: tDecode - T0, renderMs: tDone - tDecode, totalMs: tDone - T0 };
    $("made").textContent = tx("Made by selfattention (python -m selfattention report). {T} tokens, {L} × {H} heads; decoded in {decode} ms, drawn in {draw} ms. No network: everything is in this file.",
      { T, L, H, decode: Math.round(tDecode - T0), draw: Math.round(tDone - tDecode) });
    app.dataset.ready = "1";
  }
  main().catch((e) => { showError(String(e && e.stack || e)); console.error(e); });
})();
