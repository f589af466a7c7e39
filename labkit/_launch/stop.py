"""The live view's Stop button: the toolbar's interrupt, one click closer to the run.

A running cell does not receive widget events: the kernel reads them only between cells, so an
ipywidgets button clicked during a launch is heard when the launch has ended. This button
never talks to the kernel: in the browser it asks the Jupyter server to interrupt the kernel,
the very request the toolbar's ■ sends (``POST api/kernels/<id>/interrupt``). The launch then
stops as it does for ■: every rank stopped, one line to say so (``_launch/launch.py``).

It needs JupyterLab (or Notebook 7): the page's configuration gives the server's address and
token, and the output must be one the page trusts (a cell run in this session). Elsewhere it
says to use ■ instead. Standard library only.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

# The click, in the page: read JupyterLab's page configuration, send the interrupt, say so.
_JS = """(function (b) {
  var page = document.getElementById('jupyter-config-data');
  if (!page) { b.textContent = 'use the toolbar\\u2019s \\u25a0'; return; }
  page = JSON.parse(page.textContent);
  var xsrf = (document.cookie.match(/(?:^|; )_xsrf=([^;]*)/) || [])[1];
  var headers = {};
  if (page.token) { headers['Authorization'] = 'token ' + page.token; }
  if (xsrf) { headers['X-XSRFToken'] = decodeURIComponent(xsrf); }
  b.disabled = true; b.textContent = 'stopping\\u2026';
  fetch(page.baseUrl + 'api/kernels/KERNEL/interrupt', {method: 'POST', headers: headers,
                                                     credentials: 'same-origin'})
    .then(function (r) { if (!r.ok) { b.textContent = 'use the toolbar\\u2019s \\u25a0 (' + r.status + ')'; } })
    .catch(function () { b.textContent = 'use the toolbar\\u2019s \\u25a0'; });
})(this)"""


def kernel_id() -> str | None:
    """This kernel's id as the Jupyter server knows it (its connection file is
    ``kernel-<id>.json``); None outside a kernel the server started."""
    try:
        from ipykernel.connect import get_connection_file

        name = Path(get_connection_file()).name
    except Exception:   # no kernel app, no ipykernel: no button
        return None
    match = re.fullmatch(r"kernel-([0-9a-f-]+)\.json", name)
    return match[1] if match else None


def stop_button(kernel: str | None) -> str:
    """The button's HTML for the kernel ``kernel`` ("" without one)."""
    if not kernel:
        return ""
    click = html.escape(_JS.replace("KERNEL", kernel).replace("\n", " "), quote=True)
    return (f"<button class='labkit-stop' onclick=\"{click}\" title='Stop the run: the toolbar&#8217;s "
            f"interrupt (every rank is stopped)'>&#9632; Stop</button>")
