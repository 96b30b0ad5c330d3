// agentruns console: live updates by short polling. The page's #live element (data-live="poll")
// is fetched again with the header X-Console-Fragment: live and replaced when its data-version
// changed; a page whose run is terminal has no data-live and is not polled.
(function () {
  "use strict";
  var EVERY_MS = 2000;

  function busy(live) {
    // never replace a form the user is filling in
    var el = document.activeElement;
    return el && live.contains(el) && /^(INPUT|SELECT|TEXTAREA)$/.test(el.tagName);
  }

  function poll() {
    var live = document.getElementById("live");
    if (!live || live.getAttribute("data-live") !== "poll") return;
    fetch(window.location.href, {
      headers: { "X-Console-Fragment": "live" },
      credentials: "same-origin",
      cache: "no-store",
    })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) return;
        var doc = new DOMParser().parseFromString(html, "text/html");
        var fresh = doc.getElementById("live");
        if (!fresh || busy(live)) return;
        if (fresh.getAttribute("data-version") !== live.getAttribute("data-version")) {
          live.replaceWith(document.importNode(fresh, true));
        }
      })
      .catch(function () {})
      .finally(function () { window.setTimeout(poll, EVERY_MS); });
  }

  document.addEventListener("DOMContentLoaded", function () { window.setTimeout(poll, EVERY_MS); });
})();
