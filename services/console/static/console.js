// sandbox-broker console: the little htmx does not do. No inline script
// runs on these pages (CSP script-src 'self'); this file is all there is.
(function () {
  'use strict';

  function csrfToken() {
    var m = document.querySelector('meta[name="csrf-token"]');
    return m ? m.content : '';
  }

  // Every htmx request carries the page's CSRF token.
  document.addEventListener('htmx:configRequest', function (e) {
    var t = csrfToken();
    if (t) { e.detail.headers['X-CSRF-Token'] = t; }
  });

  // A run, an upload or a job that started a session: later forms use it.
  function followSession(root) {
    var marks = (root || document).querySelectorAll('[data-new-session]');
    if (!marks.length) { return; }
    var id = marks[marks.length - 1].getAttribute('data-new-session');
    if (!/^[A-Za-z0-9_-]{1,64}$/.test(id)) { return; }
    document.querySelectorAll('[data-session-field]').forEach(function (f) {
      if (!f.value) { f.value = id; }
    });
  }
  document.addEventListener('htmx:afterSwap', function (e) { followSession(e.target); });
  document.addEventListener('htmx:sseMessage', function (e) { followSession(e.target); });

  // Output panes follow their end as lines arrive.
  document.addEventListener('htmx:sseMessage', function (e) {
    var el = e.target;
    if (el && el.classList && el.classList.contains('output')) { el.scrollTop = el.scrollHeight; }
  });

  // Drag and drop onto an upload form: the dropped file goes into its
  // file input and the form is submitted as if chosen by hand.
  function zone(e) { return e.target && e.target.closest ? e.target.closest('[data-dropzone]') : null; }
  document.addEventListener('dragover', function (e) {
    var z = zone(e);
    if (z) { e.preventDefault(); z.classList.add('over'); }
  });
  document.addEventListener('dragleave', function (e) {
    var z = zone(e);
    if (z) { z.classList.remove('over'); }
  });
  document.addEventListener('drop', function (e) {
    var z = zone(e);
    if (!z) { return; }
    e.preventDefault();
    z.classList.remove('over');
    var input = z.querySelector('input[type=file]');
    if (!input || !e.dataTransfer || !e.dataTransfer.files.length) { return; }
    input.files = e.dataTransfer.files;
    htmx.trigger(z, 'submit');
  });

  // The audit desk's live tail connects when asked.
  document.addEventListener('click', function (e) {
    var b = e.target && e.target.closest ? e.target.closest('#tail-start') : null;
    if (!b) { return; }
    var body = document.getElementById('tail-body');
    var table = document.getElementById('tail-table');
    table.setAttribute('hx-ext', 'sse');
    table.setAttribute('sse-connect', b.getAttribute('data-tail-src'));
    table.setAttribute('sse-close', 'done');
    body.setAttribute('sse-swap', 'row');
    body.setAttribute('hx-swap', 'afterbegin');
    htmx.process(table);
    b.disabled = true;
    b.textContent = 'Tailing…';
  });
})();
