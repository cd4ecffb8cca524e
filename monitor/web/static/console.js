// The console's live parts: every few seconds, fetch this page again and swap in each element
// marked data-live (by id), without a reload. A part holding the focus of a text field, or a form
// being sent, is left as it is until the next round. <html data-refreshes="N"> counts the swaps
// (browser tests wait on it); data-refresh-error says why the last one failed.
(function () {
  "use strict";
  var root = document.documentElement;
  var every = parseInt(document.body.getAttribute("data-refresh-ms"), 10) || 3000;
  var count = 0;
  var sending = false;

  document.addEventListener("submit", function () { sending = true; });

  function busy(el) {
    var a = document.activeElement;
    return a && el.contains(a) && (a.tagName === "INPUT" || a.tagName === "TEXTAREA") && a.value !== "";
  }

  function refresh() {
    if (sending || document.hidden) { return schedule(); }
    fetch(location.href, { headers: { "X-Console-Refresh": "1" }, credentials: "same-origin", redirect: "manual" })
      .then(function (r) {
        if (!r.ok) { throw new Error("HTTP " + r.status); }
        return r.text();
      })
      .then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        document.querySelectorAll("[data-live][id]").forEach(function (el) {
          var fresh = doc.getElementById(el.id);
          if (fresh && !busy(el) && fresh.innerHTML !== el.innerHTML) { el.innerHTML = fresh.innerHTML; }
        });
        count += 1;
        root.setAttribute("data-refreshes", String(count));
        root.removeAttribute("data-refresh-error");
      })
      .catch(function (e) { root.setAttribute("data-refresh-error", String(e)); })
      .then(schedule);
  }

  function schedule() { window.setTimeout(refresh, every); }

  root.setAttribute("data-refreshes", "0");
  schedule();
})();
