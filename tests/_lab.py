"""JupyterLab in a real browser, for tests/test_browser.py (``make test-browser``).

Not a test module. ``Lab`` starts JupyterLab from this interpreter's environment on a free
loopback port with a random token, in smoke mode, serving a folder under /tmp (never the
repository: executed outputs stay out of it), and stops it by pid. ``Notebook`` drives one
notebook in a Chromium page the way a learner does: menus, the toolbar, Shift+Enter, typing
into a new cell. It finds cells by what they contain, never by their position, and reads what
the page shows: prompts, rank lines, images, error boxes. ``shot`` saves a screenshot of each
step for a person to look at.

Chromium is Debian's (``apt-get install chromium``): Playwright cannot download its own
browsers on a machine without internet. It starts headless, with no sandbox (root in a
container), no GPU, and none of its background connections: on a closed network those are
refused and slow every page down.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 1000}

# Waits are for what appears in the page, never fixed sleeps. They are generous: on a shared
# machine a lesson can take several times its usual time, and a wait that ends early is a
# false failure. The bars a test asserts are separate, and each says so.
START_S = 180      # JupyterLab answering, a notebook open with its kernel ready
CELL_S = 300       # one cell (a launch, a check) or Run All of a smoke-mode lesson
POLL_S = 0.1

# IPython's error box: a rule of dashes, then "SomeError   Traceback (most recent call last)".
ERROR_BOX = re.compile(r"^-{20,}\n\S+\s+Traceback \(most recent call last\)", re.M)


def find_chromium() -> str | None:
    """The path of the browser to drive: $CHROMIUM if set, else the system's Chromium; or None."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(what: str, condition, timeout: float, *, every: float = POLL_S):
    """Poll ``condition()`` until it returns something true; return that. Fails with ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(every)


def _processes():
    """(pid, working folder, command line) of every process this user may read, but this one."""
    for proc in psutil.process_iter(["cwd", "cmdline"]):
        cwd, args = proc.info["cwd"], " ".join(proc.info["cmdline"] or ())
        if proc.pid == os.getpid() or cwd is None:  # cwd None: gone already, or not ours to read
            continue
        if args.strip():
            yield proc.pid, Path(cwd), args.strip()


def processes_under(folder: Path) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose working folder lies under ``folder``:
    kernels, torchrun and ranks started for the served copy of the course."""
    return [(pid, args) for pid, cwd, args in _processes() if cwd.is_relative_to(folder)]


def processes_naming(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose command line contains ``text``."""
    return [(pid, args) for pid, _, args in _processes() if text in args]


class Lab:
    """A JupyterLab server serving ``root``, in smoke mode, importing labkit from ``source``."""

    def __init__(self, root: Path, state: Path, source: Path):
        self.root, self.state, self.source = Path(root), Path(state), Path(source)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.state / "jupyterlab.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _settings(self) -> Path:
        """A settings folder of our own: no news pop-up, no update check (no network here)."""
        folder = self.state / "settings"
        note = folder / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        return folder

    def start(self) -> None:
        """Start JupyterLab and wait until it answers. Its kernels import labkit from ``source``
        first, and get smoke mode, from the environment they inherit."""
        env = dict(os.environ, LABKIT_SMOKE="1",
                   PYTHONPATH=os.pathsep.join([str(self.source)] + [
                       p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
                   JUPYTER_CONFIG_DIR=str(self.state / "config"),
                   JUPYTER_RUNTIME_DIR=str(self.state / "runtime"),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.state / "workspaces"),
                   JUPYTERLAB_SETTINGS_DIR=str(self._settings()))
        env.pop("MPLBACKEND", None)  # charts are kept as images, as for a learner
        argv = [sys.executable, "-m", "jupyter", "lab", "--no-browser",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root}",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:
            argv.append("--allow-root")  # as `make lab` does in a container
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=self.root, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)

        def answers():
            if self.proc.poll() is not None:
                raise AssertionError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=5):
                    return True
            except OSError:
                return False
        wait_for("JupyterLab to answer", answers, START_S, every=0.5)

    def log(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def api(self, method: str, path: str):
        request = urllib.request.Request(f"{self.url}{path}?token={self.token}", method=method)
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self) -> None:
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def stop(self) -> None:
        """Stop the server by its pid: SIGTERM shuts its kernels down; SIGKILL after 60 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Notebook:
    """One notebook open in a browser page, driven as a learner drives it.

    ``path``: the notebook's file under the served root (read to find cells by content; the
    page is what every assertion reads). ``shots``: the folder for this test's screenshots.
    """

    def __init__(self, lab: Lab, context, path: Path, shots: Path):
        self.lab, self.path, self.shots = lab, Path(path), Path(shots)
        self.shots.mkdir(parents=True, exist_ok=True)
        self._shot_count = 0
        self._inserted: list[int] = []   # page positions of the cells this test added
        self.page = context.new_page()
        self.page.set_default_timeout(CELL_S * 1000)
        rel = self.path.relative_to(lab.root).as_posix()
        workspace = re.sub(r"[^A-Za-z0-9]+", "-", rel)  # a fresh workspace: only this notebook opens
        self.page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{rel}?token={lab.token}")
        self.page.wait_for_selector(".jp-NotebookPanel .jp-KernelName jp-button[aria-label^='Python']",
                                    timeout=START_S * 1000)
        self.wait_idle(START_S)
        self.shot("opened")

    # -- looking ----------------------------------------------------------------------------
    def shot(self, step: str, at=None) -> Path:
        """Save a screenshot of the page as it is now: NN-step.png in this test's folder.
        ``at``: a cell whose latest output is scrolled into view first."""
        if at is not None:
            outputs = at.locator(".jp-OutputArea-output")
            (outputs.last if outputs.count() else at).scroll_into_view_if_needed()
        self._shot_count += 1
        path = self.shots / f"{self._shot_count:02d}-{re.sub(r'[^A-Za-z0-9]+', '-', step)}.png"
        self.page.screenshot(path=str(path))
        return path

    def status(self) -> str:
        """The kernel's state as the toolbar shows it: idle, busy, restarting, ..."""
        return self.page.locator(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator").get_attribute(
            "data-status") or ""

    def wait_idle(self, timeout: float = CELL_S) -> None:
        """Until the toolbar says the kernel is idle (it stays busy while queued cells run)."""
        wait_for("the kernel to be idle", lambda: self.status() == "idle", timeout)

    def _index(self, contains: str, *, cell_type: str = "code") -> int:
        """The position of the one cell of ``cell_type`` whose source contains ``contains``, read
        from the notebook's file (the page renders only the cells in view)."""
        cells = json.loads(self.path.read_text())["cells"]
        found = [i for i, cell in enumerate(cells) if cell["cell_type"] == cell_type
                 and contains in "".join(cell["source"])]
        assert len(found) == 1, f"{self.path.name}: {len(found)} {cell_type} cells contain {contains!r}"
        return self._on_page(found[0])

    def _on_page(self, index: int) -> int:
        """Where the file's cell ``index`` is on the page, after the cells this test inserted."""
        for inserted in sorted(self._inserted):
            if inserted <= index:
                index += 1
        return index

    def code_cells(self) -> list[int]:
        """The page positions of the notebook's own code cells."""
        cells = json.loads(self.path.read_text())["cells"]
        return [self._on_page(i) for i, cell in enumerate(cells) if cell["cell_type"] == "code"]

    def cell(self, where: str | int):
        """The cell that contains ``where`` (text), or the cell at position ``where`` (an index
        found by content, or a cell this test inserted), scrolled into view and rendered."""
        index = self._index(where) if isinstance(where, str) else where
        locator = self.page.locator(
            f".jp-NotebookPanel .jp-Cell[data-windowed-list-index='{index}']")
        locator.scroll_into_view_if_needed()
        prompt = locator.locator(".jp-InputPrompt")
        wait_for(f"cell {index} to render", lambda: prompt.count() and prompt.inner_text().strip(), 30)
        if isinstance(where, str):
            first_line = where.splitlines()[0]
            wait_for(f"the cell with {first_line!r} to render",
                     lambda: first_line in locator.locator(".cm-content").inner_text(), 30)
        return locator

    def prompt(self, cell) -> str:
        """``[ ]:`` never run, ``[*]:`` running or queued, ``[7]:`` ran seventh."""
        return cell.locator(".jp-InputPrompt").inner_text().strip()

    def outputs(self, cell) -> list[dict]:
        """What the cell's output area shows, output by output: its MIME type, its visible text,
        the sources of its images."""
        return cell.evaluate("""c => [...c.querySelectorAll('.jp-OutputArea-output')].map(o => ({
            mime: o.dataset.mimeType || '',
            text: o.innerText,
            images: [...o.querySelectorAll('img')].map(i => i.getAttribute('src') || ''),
        }))""")

    def text(self, cell) -> str:
        return "\n".join(o["text"] for o in self.outputs(cell))

    def errors(self, cell) -> list[str]:
        """The error boxes (a traceback the kernel raised) the cell shows."""
        return [o["text"] for o in self.outputs(cell) if ERROR_BOX.search(o["text"])]

    # -- doing ------------------------------------------------------------------------------
    def select(self, where: str | int):
        """Click the cell's prompt: selects it, in command mode."""
        cell = self.cell(where)
        cell.locator(".jp-InputPrompt").click()
        return cell

    def run(self, where: str | int, *, wait: bool = True):
        """Select the cell and press Shift+Enter, as a learner does; wait for it to finish
        (``wait=False``: only until it has started)."""
        cell = self.select(where)
        before = self.prompt(cell)
        self.page.keyboard.press("Shift+Enter")
        wait_for("the cell to start", lambda: self.prompt(cell) != before, 60, every=0.02)
        if wait:
            self.wait_done(cell)
        return cell

    def wait_done(self, cell, timeout: float = CELL_S) -> str:
        """Until the cell has run (its prompt holds a number again); return the prompt."""
        def ran():
            prompt = self.prompt(cell)
            return prompt if re.fullmatch(r"\[\d+\]:", prompt) else ""
        return wait_for("the cell to finish", ran, timeout)

    def menu(self, menu: str, item: str) -> None:
        """Click ``menu`` in the menu bar, then ``item`` in it."""
        self.page.locator(".lm-MenuBar-item", has_text=re.compile(rf"^{re.escape(menu)}$")).click()
        self.page.get_by_role("menuitem", name=item, exact=True).click()

    def run_all(self, timeout: float = CELL_S) -> None:
        """Run > Run All Cells, then wait until every cell has run."""
        self.menu("Run", "Run All Cells")
        wait_for("Run All to start", lambda: self.status() == "busy", 60, every=0.05)
        self.wait_idle(timeout)

    def run_all_above(self, where: str) -> None:
        """Select the cell, then Run > Run All Above Selected Cell; wait until they have run."""
        self.select(where)
        self.menu("Run", "Run All Above Selected Cell")
        wait_for("the cells above to start", lambda: self.status() == "busy", 60, every=0.05)
        self.wait_idle()

    def insert_below(self, where: str | int, source: str) -> int:
        """A new code cell below ``where``, holding ``source`` (typed as a learner pastes it);
        returns its position. It is not run."""
        cell = self.select(where)
        index = int(cell.get_attribute("data-windowed-list-index"))
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("b")        # command mode: insert a cell below
        new = self.page.locator(
            f".jp-NotebookPanel .jp-Cell[data-windowed-list-index='{index + 1}']")
        wait_for("the new cell", lambda: new.count() and "jp-mod-active" in (new.get_attribute("class") or ""), 30)
        self.page.keyboard.press("Enter")    # edit mode
        self.page.keyboard.insert_text(source)
        self.page.keyboard.press("Escape")
        self._inserted.append(index + 1)
        return index + 1

    def toolbar(self, name: str) -> None:
        """Click the notebook toolbar's button ``name`` (interrupt, restart, run, save, ...)."""
        self.page.locator(f".jp-NotebookPanel-toolbar [data-jp-item-name='{name}'] jp-button").click()

    def save(self) -> dict:
        """Ctrl+S in the notebook; return the saved notebook as JSON."""
        before = self.path.stat().st_mtime_ns
        self.page.locator(".jp-NotebookPanel .jp-Notebook").focus()
        self.page.keyboard.press("Control+s")
        def saved():
            if self.path.stat().st_mtime_ns == before:
                return None
            try:   # the server may be writing it still
                return json.loads(self.path.read_text())
            except ValueError:
                return None
        notebook = wait_for("the notebook to be saved", saved, 60)
        self._inserted = []   # the file holds them now
        return notebook

    def close(self) -> None:
        self.page.close()
