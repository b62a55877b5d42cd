// attnviz heatmap viewer: a capture's per-head maps, swapped in the browser when a slider moves.
// One script for three homes (a Streamlit component, an anywidget, a static HTML file): each
// calls attnvizHeatmap(root, data, host) with the payload of attnviz/viewer/payload.py and a host
// {request(layer), region(box), view(v)} whose members may be missing (a static file has none).
// No dependencies, no network: images are data URIs decoded by the browser.
(function () {
  "use strict";
  const CACHE = 160; // decoded maps kept (<= 1 MB each at 512 px)
  const SIDE = 512;  // drawn map side in CSS px at most

  function el(tag, cls, parent, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  function hexToRgb(h) {
    return [parseInt(h.slice(1, 3), 16), parseInt(h.slice(3, 5), 16), parseInt(h.slice(5, 7), 16)];
  }

  function fmt(v) {
    if (!isFinite(v)) return "–";
    if (v === 0) return "0";
    const a = Math.abs(v);
    return a >= 0.01 && a < 1000 ? v.toPrecision(4) : v.toExponential(3);
  }

  function tick(v) {  // colour-bar labels: three significant digits, no trailing zeros
    return Math.abs(v) >= 1e-3 || v === 0 ? String(parseFloat(v.toPrecision(3))) : v.toExponential(1);
  }

  function tok(t) {
    const s = JSON.stringify(t === undefined ? "" : t);
    return s.length > 24 ? s.slice(0, 22) + "…\"" : s;
  }

  // PNG text chunks, as Pillow's PngInfo.add_itxt writes them (what every other export embeds).
  const CRC = new Uint32Array(256).map((_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  function crc32(bytes) {
    let c = 0xFFFFFFFF;
    for (let i = 0; i < bytes.length; i++) c = CRC[(c ^ bytes[i]) & 0xFF] ^ (c >>> 8);
    return (c ^ 0xFFFFFFFF) >>> 0;
  }
  function itxt(keyword, text) {  // keyword, NUL, uncompressed, no language, no translated keyword, UTF-8 text
    const enc = new TextEncoder(), key = enc.encode(keyword), body = enc.encode(text);
    const chunk = new Uint8Array(12 + key.length + 5 + body.length), view = new DataView(chunk.buffer);
    view.setUint32(0, key.length + 5 + body.length);
    chunk.set(enc.encode("iTXt"), 4); chunk.set(key, 8); chunk.set(body, 8 + key.length + 5);
    view.setUint32(chunk.length - 4, crc32(chunk.subarray(4, chunk.length - 4)));
    return chunk;
  }
  function dataBytes(uri) {
    const raw = atob(uri.split(",")[1]), out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }
  function withText(png, entries) {  // the chunks right after IHDR (8 bytes of signature, then 25 of IHDR)
    const chunks = entries.map(([k, v]) => itxt(k, v));
    const out = new Uint8Array(png.length + chunks.reduce((a, c) => a + c.length, 0));
    out.set(png.subarray(0, 33), 0);
    let at = 33;
    chunks.forEach((c) => { out.set(c, at); at += c.length; });
    out.set(png.subarray(33), at);
    return out;
  }

  // Pixels of an image data URI, decoded once.
  function pixels(uri) {
    return new Promise((resolve, reject) => {
      const img = new Image();
      img.onload = () => {
        const c = document.createElement("canvas");
        c.width = img.naturalWidth; c.height = img.naturalHeight;
        const ctx = c.getContext("2d", {willReadFrequently: true});
        ctx.drawImage(img, 0, 0);
        resolve(ctx.getImageData(0, 0, c.width, c.height));
      };
      img.onerror = () => reject(new Error("cannot decode an attnviz image"));
      img.src = uri;
    });
  }

  // Where each keyed viewer rests, kept outside its element: a host that remounts the element (a
  // Streamlit rerun may) gets the same view back for the same capture instead of the first one.
  const VIEWS = new Map();

  function Viewer(root, data, host, key) {
    this.root = root; this.host = host || {}; this.key = key || null;
    this.cache = new Map(); this.pending = new Map(); this.asked = new Set();
    this.state = null; this.drag = null; this.viewTimer = null;
    this.build();
    this.update(data);
  }

  Viewer.prototype.build = function () {
    const r = this.root;
    r.classList.add("avz-root");
    r.innerHTML = "";
    const bar = el("div", "avz-controls", r);
    const lw = el("label", "avz-ctl", bar); this.layerLabel = el("span", "avz-ctl-label", lw, "Layer");
    this.layerInput = el("input", "avz-layer", lw); this.layerInput.type = "range"; this.layerInput.min = 0;
    this.layerInput.setAttribute("aria-label", "Layer");
    const hw = el("label", "avz-ctl", bar); this.headLabel = el("span", "avz-ctl-label", hw, "Head");
    this.headInput = el("input", "avz-head", hw); this.headInput.type = "range"; this.headInput.min = 0;
    this.headInput.setAttribute("aria-label", "Head");
    const gw = el("label", "avz-check", bar); this.logInput = el("input", "avz-log", gw); this.logInput.type = "checkbox";
    el("span", null, gw, "Log scale");
    const nw = el("label", "avz-check", bar); this.rowInput = el("input", "avz-rownorm", nw); this.rowInput.type = "checkbox";
    el("span", null, nw, "Row-normalise");
    this.pngButton = el("button", "avz-png", bar, "PNG");
    this.pngButton.title = "Download the maps as drawn (PNG)";
    this.panelsBox = el("div", "avz-panels", r);
    this.note = el("div", "avz-note", r);
    this.tip = el("div", "avz-tip", r); this.tip.style.display = "none";
    const move = () => { this.readControls(); this.render(); this.reportView(); };
    this.layerInput.addEventListener("input", move);
    this.headInput.addEventListener("input", move);
    this.logInput.addEventListener("change", move);
    this.rowInput.addEventListener("change", move);
    this.pngButton.addEventListener("click", () => this.download());
  };

  Viewer.prototype.update = function (data) {
    if (this.data && data.id === this.data.id) {  // same capture: new layers only, the view stays
      const known = this.data;
      data.panels.forEach((p, i) => Object.assign(known.panels[i].layers, p.layers));
      this.asked.clear();
      this.jump(data.jump);
      this.render();
      return;
    }
    this.data = data; this.cache.clear(); this.asked.clear();
    const layers = data.layers;
    this.layerInput.max = layers.length - 1;
    this.headInput.max = data.n_heads;  // 0: mean, then heads
    const kept = this.key !== null ? VIEWS.get(this.key) : null;
    const v = kept && kept.id === data.id ? kept : (data.view || {});
    const li = Math.max(0, layers.indexOf(v.layer === undefined || v.layer === null ? layers[layers.length - 1] : v.layer));
    this.layerInput.value = li;
    this.headInput.value = v.head === undefined || v.head === null ? 0 : v.head + 1;
    this.logInput.checked = !!v.log;
    this.rowInput.checked = !!(v.row_normalise || v.row);
    const enc = data.encoding;
    this.lut = data.palette.map(hexToRgb);
    this.maskRgb = hexToRgb(data.masked);
    this.top = Math.pow(2, enc.bits) - 1;
    this.panelsBox.innerHTML = "";
    this.panels = data.panels.map((p) => {
      const box = el("div", "avz-panel", this.panelsBox);
      const title = el("div", "avz-title", box);
      const canvas = el("canvas", "avz-canvas", box);
      const sel = el("div", "avz-select", box); sel.style.display = "none";
      const panel = {spec: p, box, title, canvas, sel};
      this.bindPointer(panel);
      return panel;
    });
    this.jumped = kept && kept.id === data.id ? kept.jumped : null;
    this.jump(data.jump);
    this.readControls();
    this.render();
  };

  // The host moves the view (a click on an overview tile): {layer, head, n}, acted on once per n.
  Viewer.prototype.jump = function (j) {
    if (!j || j.n === this.jumped) return;
    this.jumped = j.n;
    const li = this.data.layers.indexOf(j.layer);
    if (li >= 0) this.layerInput.value = li;
    this.headInput.value = j.head === null || j.head === undefined ? 0 : j.head + 1;
    this.readControls();
  };

  Viewer.prototype.readControls = function () {
    const d = this.data;
    const layer = d.layers[+this.layerInput.value];
    const hi = +this.headInput.value;
    this.state = {layer, head: hi === 0 ? null : hi - 1, log: this.logInput.checked, row: this.rowInput.checked};
    if (this.key !== null) VIEWS.set(this.key, Object.assign({id: d.id, jumped: this.jumped}, this.state));
    this.layerLabel.textContent = "Layer " + layer;
    this.headLabel.textContent = "Head " + (hi === 0 ? "mean" : (hi - 1) + " (g" + d.kv_groups[hi - 1] + ")");
  };

  Viewer.prototype.reportView = function () {  // tell the host where the view is, once it rests
    if (!this.host.view) return;
    clearTimeout(this.viewTimer);
    const s = this.state;
    this.viewTimer = setTimeout(() => this.host.view({layer: s.layer, head: s.head, log: s.log}), 700);
  };

  // Decoded values of (panel, layer, head): Float32Array of p (NaN: masked), or null while decoding.
  Viewer.prototype.values = function (pi, layer, head) {
    const key = pi + "|" + layer + "|" + head;
    if (this.cache.has(key)) {
      const v = this.cache.get(key); this.cache.delete(key); this.cache.set(key, v); return v;
    }
    const spec = this.data.panels[pi].layers[String(layer)];
    if (!spec) return null;
    if (!this.pending.has(key)) {
      const enc = this.data.encoding, top = this.top, span = enc.hi - enc.lo, sixteen = enc.bits === 16;
      const job = Promise.all([pixels(spec.heads[head === null ? 0 : head + 1]), this.mask(pi, layer, spec)])
        .then(([img, allowed]) => {
          const n = img.width * img.height, px = img.data, out = new Float32Array(n);
          for (let i = 0; i < n; i++) {
            if (!allowed[i]) { out[i] = NaN; continue; }
            const code = sixteen ? px[4 * i] * 256 + px[4 * i + 1] : px[4 * i];
            out[i] = code === 0 && !sixteen ? 0 : Math.pow(10, enc.lo + (code / top) * span);
          }
          const v = {w: img.width, h: img.height, p: out, factor: spec.factor};
          this.cache.set(key, v); this.pending.delete(key);
          while (this.cache.size > CACHE) this.cache.delete(this.cache.keys().next().value);
          return v;
        });
      this.pending.set(key, job);
      job.then(() => this.render(), (e) => { this.note.textContent = String(e); });
    }
    return null;
  };

  Viewer.prototype.mask = function (pi, layer, spec) {
    const key = "mask|" + pi + "|" + layer;
    if (!this.masks) this.masks = new Map();
    if (!this.masks.has(key)) {
      this.masks.set(key, pixels(spec.mask).then((img) => {
        const n = img.width * img.height, a = new Uint8Array(n);
        for (let i = 0; i < n; i++) a[i] = img.data[4 * i] > 127 ? 1 : 0;
        return a;
      }));
    }
    return this.masks.get(key);
  };

  Viewer.prototype.render = function () {
    const s = this.state, d = this.data;
    if (!s) return;
    const missing = d.panels.some((p) => !p.layers[String(s.layer)]);
    if (missing) {
      if (this.host.request && !this.asked.has(s.layer)) {
        this.asked.add(s.layer);
        this.requests = (this.requests || 0) + 1;  // round trips so far (the latency benchmark counts them)
        this.host.request(s.layer);
      }
      this.note.textContent = this.host.request ? "Loading layer " + s.layer + " …"
        : "Layer " + s.layer + " is not in this file (made with fewer layers).";
      return;
    }
    const maps = this.panels.map((_, pi) => this.values(pi, s.layer, s.head));
    if (maps.some((m) => m === null)) return;  // drawn when decoded
    // one colour range for every panel: [0, max] linear, [log10 floor, log10 max] log
    let max = 0;
    const shown = maps.map((m) => this.rowNormalised(m));
    shown.forEach((m) => { for (let i = 0; i < m.p.length; i++) if (m.p[i] > max) max = m.p[i]; });
    const floor = Math.log10(d.floor);
    const lo = s.log ? floor : 0, hi = s.log ? Math.max(Math.log10(Math.max(max, d.floor)), floor + 1e-6) : Math.max(max, 1e-6);
    this.range = [lo, hi];
    this.panels.forEach((panel, pi) => this.draw(panel, shown[pi], lo, hi));
    this.note.textContent = this.noteText(maps[0]);
    this.prefetch();
  };

  Viewer.prototype.rowNormalised = function (m) {
    if (!this.state.row) return m;
    const out = new Float32Array(m.p.length);
    for (let y = 0; y < m.h; y++) {
      let top = 0;
      for (let x = 0; x < m.w; x++) { const v = m.p[y * m.w + x]; if (v > top) top = v; }
      for (let x = 0; x < m.w; x++) { const v = m.p[y * m.w + x]; out[y * m.w + x] = top > 0 ? v / top : v; }
    }
    return {w: m.w, h: m.h, p: out, factor: m.factor};
  };

  Viewer.prototype.noteText = function (m) {
    const d = this.data;
    let t = m.factor > 1 ? "Each pixel is the maximum of " + m.factor + " × " + m.factor + " tokens (sinks stay visible). "
      : "Full resolution: hover a cell for its tokens and value. ";
    t += this.host.region ? "Drag a box to see a region at full resolution." :
      (d.regions_note || "Regions at full resolution need the app; this file is static.");
    return (d.note ? d.note + " · " : "") + t;
  };

  Viewer.prototype.draw = function (panel, m, lo, hi) {
    const s = this.state, d = this.data, lut = this.lut, span = hi - lo || 1;
    const img = new ImageData(m.w, m.h), px = img.data, mask = this.maskRgb;
    for (let i = 0; i < m.p.length; i++) {
      const v = m.p[i];
      let c;
      if (v !== v) c = mask;
      else {
        const z = s.log ? Math.log10(Math.max(v, d.floor)) : v;
        c = lut[Math.max(0, Math.min(255, Math.round(((z - lo) / span) * 255)))];
      }
      px[4 * i] = c[0]; px[4 * i + 1] = c[1]; px[4 * i + 2] = c[2]; px[4 * i + 3] = 255;
    }
    const src = document.createElement("canvas");
    src.width = m.w; src.height = m.h; src.getContext("2d").putImageData(img, 0, 0);
    // layout: map, axes (left, bottom), colour bar (right)
    const room = Math.max(160, Math.min(SIDE, (this.panelsBox.clientWidth || SIDE * this.panels.length) / this.panels.length - 152));
    const scale = room / Math.max(m.w, m.h);
    const W = Math.round(m.w * scale), H = Math.round(m.h * scale);
    const left = 64, top = 8, bottom = 46, right = 78;
    const dpr = window.devicePixelRatio || 1, c = panel.canvas;
    c.width = (left + W + right) * dpr; c.height = (top + H + bottom) * dpr;
    c.style.width = left + W + right + "px"; c.style.height = top + H + bottom + "px";
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.fillStyle = "#fff"; g.fillRect(0, 0, left + W + right, top + H + bottom);
    g.imageSmoothingEnabled = false;
    g.drawImage(src, left, top, W, H);
    g.strokeStyle = "#444"; g.lineWidth = 1; g.strokeRect(left - 0.5, top - 0.5, W + 1, H + 1);
    panel.geom = {left, top, W, H, m};
    this.axes(g, left, top, W, H, m);
    this.colourBar(g, left + W + 14, top, Math.min(H, 260), lo, hi);
    const head = d.head_labels ? d.head_labels[s.head === null ? 0 : s.head + 1] : (s.head === null ? "mean over heads" : "head " + s.head);
    panel.title.textContent = "layer " + s.layer + " · " + (panel.spec.masks[String(s.layer)] || "") + " · " + head
      + (this.panels.length > 1 ? " — " + panel.spec.title : "");
    panel.title.setAttribute("data-layer", s.layer);
    panel.title.setAttribute("data-head", s.head === null ? "mean" : s.head);
    c.setAttribute("data-shown", s.layer + "/" + (s.head === null ? "mean" : s.head) + "/" + (s.log ? "log" : "linear"));
  };

  Viewer.prototype.axes = function (g, left, top, W, H, m) {
    const d = this.data, rows = d.row_tokens || d.tokens, cols = d.tokens;
    const nq = rows.length, nk = cols.length;
    g.fillStyle = "#222"; g.font = "11px Arial, Helvetica, sans-serif";
    const labels = nq <= 40 && nk <= 40 && m.factor === 1;
    const ticks = (n) => {
      if (labels) return [...Array(n).keys()];
      const step = [1, 2, 5, 10, 20, 50, 100, 200, 250, 500, 1000, 2000, 5000].find((s) => n / s <= 6) || Math.ceil(n / 6);
      const out = []; for (let t = 0; t < n; t += step) out.push(t); return out;
    };
    g.textAlign = "right"; g.textBaseline = "middle";
    for (const t of ticks(nq)) {
      const y = top + ((t + 0.5) / (m.h * m.factor)) * H;
      g.fillText(labels ? tok(rows[t]).slice(1, -1).slice(0, 9) : String(t), left - 4, y);
    }
    g.save();
    for (const t of ticks(nk)) {
      const x = left + ((t + 0.5) / (m.w * m.factor)) * W;
      if (labels) {
        g.save(); g.translate(x, top + H + 4); g.rotate(-Math.PI / 3); g.textAlign = "right";
        g.fillText(tok(cols[t]).slice(1, -1).slice(0, 9), 0, 0); g.restore();
      } else { g.textAlign = "center"; g.textBaseline = "top"; g.fillText(String(t), x, top + H + 4); }
    }
    g.restore();
    g.textAlign = "center"; g.textBaseline = "bottom";
    g.fillText(d.row_tokens ? "source (key)" : "key", left + W / 2, top + H + 44);
    g.save(); g.translate(12, top + H / 2); g.rotate(-Math.PI / 2); g.textBaseline = "middle";
    g.fillText(d.row_tokens ? "target (query)" : "query", 0, 0); g.restore();
  };

  Viewer.prototype.colourBar = function (g, x, y, h, lo, hi) {
    const lut = this.lut;
    for (let i = 0; i < h; i++) {
      const c = lut[Math.round((1 - i / (h - 1)) * 255)];
      g.fillStyle = "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")"; g.fillRect(x, y + i, 12, 1);
    }
    g.strokeStyle = "#444"; g.strokeRect(x - 0.5, y - 0.5, 13, h + 1);
    g.fillStyle = "#222"; g.textAlign = "left"; g.textBaseline = "middle"; g.font = "10px Arial, Helvetica, sans-serif";
    for (let k = 0; k <= 4; k++) {
      const z = lo + ((hi - lo) * k) / 4;
      const whole = Math.abs(z - Math.round(z)) < 1e-6;
      g.fillText(this.state.log ? (whole ? "1e" + Math.round(z) : tick(Math.pow(10, z))) : tick(z), x + 16, y + h - (h * k) / 4);
    }
    g.save(); g.translate(x + 70, y + h / 2); g.rotate(Math.PI / 2); g.textAlign = "center";
    g.fillText((this.state.log ? "log10 " : "") + (this.state.row ? "row-normalised" : "attention"), 0, 0); g.restore();
  };

  Viewer.prototype.cell = function (panel, ev) {
    const gm = panel.geom; if (!gm) return null;
    const r = panel.canvas.getBoundingClientRect();
    const x = ev.clientX - r.left - gm.left, y = ev.clientY - r.top - gm.top;
    if (x < 0 || y < 0 || x >= gm.W || y >= gm.H) return null;
    return {col: Math.floor((x / gm.W) * gm.m.w), row: Math.floor((y / gm.H) * gm.m.h), x, y};
  };

  Viewer.prototype.bindPointer = function (panel) {
    const c = panel.canvas;
    c.addEventListener("mousemove", (ev) => {
      const at = this.cell(panel, ev);
      if (this.drag && this.drag.panel === panel) this.dragTo(panel, ev);
      if (!at) { this.tip.style.display = "none"; return; }
      this.hover(panel, at, ev);
    });
    c.addEventListener("mouseleave", () => { this.tip.style.display = "none"; });
    c.addEventListener("mousedown", (ev) => {
      const at = this.cell(panel, ev); if (!at) return;
      ev.preventDefault();
      this.drag = {panel, start: at};
    });
    window.addEventListener("mouseup", (ev) => {
      if (!this.drag || this.drag.panel !== panel) return;
      const start = this.drag.start, end = this.cell(panel, ev) || start;
      this.drag = null; panel.sel.style.display = "none";
      if (Math.abs(end.x - start.x) < 4 && Math.abs(end.y - start.y) < 4) return;  // a click, not a box
      const f = panel.geom.m.factor, d = this.data;
      const nq = (d.row_tokens || d.tokens).length, nk = d.tokens.length;
      const box = {layer: this.state.layer, head: this.state.head,
        queries: [Math.min(start.row, end.row) * f, Math.min(nq, (Math.max(start.row, end.row) + 1) * f)],
        keys: [Math.min(start.col, end.col) * f, Math.min(nk, (Math.max(start.col, end.col) + 1) * f)]};
      if (this.host.region) {
        this.note.textContent = "Asking for layer " + box.layer + ", queries " + box.queries[0] + "–" + (box.queries[1] - 1)
          + " × keys " + box.keys[0] + "–" + (box.keys[1] - 1) + " at full resolution …";
        this.host.region(box);
      } else {
        this.note.textContent = this.data.regions_note || "A region at full resolution needs the app; this file is static.";
      }
    });
  };

  Viewer.prototype.dragTo = function (panel, ev) {
    const gm = panel.geom, r = panel.canvas.getBoundingClientRect(), a = this.drag.start;
    const x = Math.max(0, Math.min(gm.W, ev.clientX - r.left - gm.left)), y = Math.max(0, Math.min(gm.H, ev.clientY - r.top - gm.top));
    const s = panel.sel.style;
    const c = panel.canvas;
    s.display = "block"; s.left = c.offsetLeft + gm.left + Math.min(a.x, x) + "px"; s.top = c.offsetTop + gm.top + Math.min(a.y, y) + "px";
    s.width = Math.abs(x - a.x) + "px"; s.height = Math.abs(y - a.y) + "px";
  };

  Viewer.prototype.hover = function (panel, at, ev) {
    const d = this.data, m = panel.geom.m, f = m.factor, rows = d.row_tokens || d.tokens, cols = d.tokens;
    const maps = this.values(this.panels.indexOf(panel), this.state.layer, this.state.head);
    if (!maps) return;
    const v = maps.p[at.row * m.w + at.col];
    const approx = d.encoding.bits === 8 ? "≈ " : "= ";
    let text;
    if (f === 1) {
      text = "query " + at.row + " " + tok(rows[at.row]) + " → key " + at.col + " " + tok(cols[at.col]) + "\n"
        + (v !== v ? "masked" : "p " + approx + fmt(v));
    } else {
      const q0 = at.row * f, k0 = at.col * f;
      text = "queries " + q0 + "–" + (Math.min(rows.length, q0 + f) - 1) + ", keys " + k0 + "–" + (Math.min(cols.length, k0 + f) - 1) + "\n"
        + (v !== v ? "masked" : "max p " + approx + fmt(v));
    }
    this.tip.textContent = text;
    const r = this.root.getBoundingClientRect();
    this.tip.style.display = "block";
    this.tip.style.left = ev.clientX - r.left + 14 + "px"; this.tip.style.top = ev.clientY - r.top + 14 + "px";
  };

  Viewer.prototype.prefetch = function () {  // the next moves: neighbouring layers, other heads
    const s = this.state, d = this.data, li = d.layers.indexOf(s.layer), jobs = [];
    for (const dl of [1, -1, 2, -2]) {
      const l = d.layers[li + dl];
      if (l !== undefined) jobs.push([l, s.head]);
    }
    for (let h = -1; h < d.n_heads; h++) jobs.push([s.layer, h < 0 ? null : h]);
    clearTimeout(this.prefetchTimer);
    const step = () => {
      const job = jobs.shift(); if (!job) return;
      d.panels.forEach((p, pi) => { if (p.layers[String(job[0])]) this.values(pi, job[0], job[1]); });
      this.prefetchTimer = setTimeout(step, 5);
    };
    this.prefetchTimer = setTimeout(step, 30);
  };

  Viewer.prototype.download = function () {  // the panels side by side as drawn, one PNG
    const cs = this.panels.map((p) => p.canvas), titles = this.panels.map((p) => p.title.textContent);
    const out = document.createElement("canvas"), dpr = window.devicePixelRatio || 1, head = 22 * dpr;
    out.width = cs.reduce((a, c) => a + c.width, 0); out.height = Math.max(...cs.map((c) => c.height)) + head;
    const g = out.getContext("2d"); g.fillStyle = "#fff"; g.fillRect(0, 0, out.width, out.height);
    g.fillStyle = "#222"; g.font = 12 * dpr + "px Arial, Helvetica, sans-serif"; g.textBaseline = "top";
    let x = 0;
    cs.forEach((c, i) => { g.fillText(titles[i], x + 8 * dpr, 4 * dpr); g.drawImage(c, x, head); x += c.width; });
    const a = document.createElement("a"), s = this.state, d = this.data;
    a.download = "attnviz_layer" + s.layer + "_" + (s.head === null ? "mean" : "h" + s.head) + ".png";
    // the metadata every other export writes (attnviz/figures/export.py), with the view as drawn
    const meta = Object.assign({}, d.meta || {}, {layer: s.layer, mask: d.panels[0].masks[String(s.layer)],
      head: s.head === null ? "mean" : s.head, figure: "viewer", scale: s.log ? "log" : "linear",
      row_normalise: !!s.row});
    meta.panels = (meta.panels || []).map((p, i) => Object.assign({}, p, {mask: d.panels[i].masks[String(s.layer)]}));
    const png = withText(dataBytes(out.toDataURL("image/png")),
      [["attnviz", JSON.stringify(meta)], ["Description", meta.model + " · " + meta.arch]]);
    a.href = URL.createObjectURL(new Blob([png], {type: "image/png"})); a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 60000);
  };

  // key: the host's name for this viewer (a Streamlit component key); with one, the view survives a remount.
  const api = function (root, data, host, key) {
    if (root.__attnviz) { root.__attnviz.host = host || {}; root.__attnviz.update(data); return root.__attnviz; }
    root.__attnviz = new Viewer(root, data, host, key);
    return root.__attnviz;
  };
  (typeof globalThis !== "undefined" ? globalThis : window).attnvizHeatmap = api;
})();
