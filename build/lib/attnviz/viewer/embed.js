// attnviz: an offline renderer for anywidget outputs in a notebook exported to HTML (nbconvert's
// widget_renderer_url). The standard renderer loads the widget manager from a CDN; this one reads
// the saved widget state in the page, imports each anywidget's own script (_esm, saved with it)
// and renders it with a model that serves the saved values. Nothing is fetched.
(function () {
  "use strict";
  async function renderAll() {
    const stateEl = document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]');
    if (!stateEl) return;
    const state = JSON.parse(stateEl.textContent).state || {};
    for (const viewEl of document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')) {
      const view = JSON.parse(viewEl.textContent);
      const saved = state[view.model_id];
      if (!saved || !saved.state || typeof saved.state._esm !== "string") continue;  // not an anywidget
      const values = Object.assign({}, saved.state), handlers = {};
      const model = {
        get: (k) => values[k],
        set: (k, v) => { values[k] = v; },
        save_changes: () => {},
        on: (name, cb) => { (handlers[name] = handlers[name] || []).push(cb); },
        off: () => {},
        send: () => {},
        widget_manager: {},
      };
      if (values._css) {
        const style = document.createElement("style");
        style.textContent = values._css;
        document.head.appendChild(style);
      }
      const url = "data:text/javascript;base64," + btoa(unescape(encodeURIComponent(values._esm)));
      const mod = await import(url);
      let widget = mod.default;
      if (typeof widget === "function") widget = await widget();
      const el = document.createElement("div");
      el.className = "attnviz-offline-widget";
      viewEl.parentElement.insertBefore(el, viewEl);
      if (widget.initialize) await widget.initialize({model});
      await widget.render({model, el});
    }
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", renderAll);
  else renderAll();
})();
