// gorm-outbox operator UI: refreshes the overview's numbers in place.
// The fragment is rendered (and escaped) on the server; nothing here
// builds markup from data.
(function () {
  "use strict";
  var live = document.getElementById("live");
  var status = document.getElementById("live-status");
  if (!live || !status) return;
  var interval = parseInt(live.getAttribute("data-refresh-ms"), 10) || 2000;
  function show(text, cls) { status.textContent = text; status.className = cls; }
  function tick() {
    if (document.hidden) { setTimeout(tick, interval); return; }
    fetch("live", { cache: "no-store", credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) {
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.text();
      })
      .then(function (html) {
        live.innerHTML = html;
        show("live · updated " + new Date().toLocaleTimeString(), "ok");
        document.body.setAttribute("data-refreshed", String(Date.now()));
      })
      .catch(function (e) { show("refresh failed (" + e.message + "); retrying", "err"); })
      .then(function () { setTimeout(tick, interval); });
  }
  setTimeout(tick, interval);
})();
