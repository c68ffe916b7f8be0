"""A page open in headless Chromium with the network off, as the HTML page tests see it:
its DOM once its scripts have run (``load``), every console message, and every http(s) request
the page made (from Chromium's net log); and the page's embedded data (``embedded``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

from nanokv_cli.views.html_page import DATA_ID

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Network off: every request goes to a closed local port and no host name resolves, so a
# page that needs a CDN draws nothing. The background-networking flags only quiet Chromium's
# own update and sign-in calls; the net log below tells those from the page's anyway.
NETWORK_OFF = (
    "--proxy-server=127.0.0.1:9",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--disable-background-networking",
    "--disable-component-update",
)
BROWSER_FLAGS = (
    "--headless=new",
    "--no-sandbox",  # tests run as root in containers, where the sandbox cannot start
    "--disable-gpu",
    "--no-first-run",
    *NETWORK_OFF,
    # Console messages come out on stderr as "...:INFO:CONSOLE:1] "msg", source: url (1)".
    "--enable-logging=stderr",
    "--v=0",
    # Virtual time runs the page's scripts and timers to quiet before the DOM is dumped.
    "--virtual-time-budget=5000",
    "--window-size=1200,900",
)


LOAD_TIMEOUT_S = 60  # a page loads in 1-3 s


def chromium_path() -> str | None:
    """The headless browser to use: $NANOKV_CHROMIUM, else the first Chromium on PATH."""
    override = os.environ.get("NANOKV_CHROMIUM")
    if override:
        return override
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def require_chromium() -> str:
    # A missing browser fails, not skips: a skipped page test reads as a passing one. Change
    # this one function to pytest.skip where a machine is not meant to have Chromium.
    path = chromium_path()
    if path is None:
        pytest.fail(
            "the HTML page tests need headless Chromium and none was found "
            f"(looked for {', '.join(CHROMIUM_NAMES)} on PATH, and $NANOKV_CHROMIUM): "
            "install it with `apt-get install -y chromium`",
            pytrace=False,
        )
    return path


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    parent: Node | None
    text: list[str] = field(default_factory=list)

    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def inside(self, other: Node) -> bool:
        up = self.parent
        while up is not None:
            if up is other:
                return True
            up = up.parent
        return False


class Dom(HTMLParser):
    """A flat list of elements with their parents: enough to count what plotly drew."""

    VOID = {
        "area",
        "base",
        "br",
        "col",
        "embed",
        "hr",
        "img",
        "input",
        "link",
        "meta",
        "source",
        "track",
        "wbr",
    }

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.nodes: list[Node] = []
        self.stack: list[Node] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs}, self.stack[-1] if self.stack else None)
        self.nodes.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        for node in self.stack:
            node.text.append(data)

    def by_id(self, ident: str) -> Node:
        found = [n for n in self.nodes if n.attrs.get("id") == ident]
        assert len(found) == 1, f"{len(found)} elements with id {ident!r}"
        return found[0]

    def find(self, within: Node | None = None, *, tag=None, cls=None, **attrs) -> list[Node]:
        return [
            n
            for n in self.nodes
            if (within is None or n.inside(within))
            and (tag is None or n.tag == tag)
            and (cls is None or cls in n.classes())
            and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]


@dataclass
class Loaded:
    dom: Dom
    console: list[str]  # every console message the page logged
    requests: list[str]  # every http(s) URL the page asked for


CONSOLE_LINE = re.compile(r":(INFO|WARNING|ERROR|VERBOSE\d*):CONSOLE[^\]]*\] (.*)$")
# Chromium logs every console level as INFO here, so console.error() looks like console.log();
# what it cannot hide is an uncaught exception or a parse error, which is what this catches.
ERROR_WORDS = re.compile(r"Uncaught|\b\w*Error\b")


def console_messages(stderr: str) -> list[str]:
    return [m.group(0) for line in stderr.splitlines() if (m := CONSOLE_LINE.search(line))]


def console_errors(messages: list[str]) -> list[str]:
    return [m for m in messages if ":ERROR:CONSOLE" in m or ERROR_WORDS.search(m)]


def page_requests(net_log: Path) -> list[str]:
    """The http(s) requests the page made, from Chromium's net log. The browser's own calls
    have no origin; a file:// page's have the opaque origin "null"."""
    log, _ = json.JSONDecoder().raw_decode(net_log.read_text())
    names = {v: k for k, v in log["constants"]["logEventTypes"].items()}
    urls = []
    for event in log["events"]:
        params = event.get("params") or {}
        if names.get(event["type"]) != "URL_REQUEST_START_JOB":
            continue
        initiator = params.get("initiator") or ""
        if (initiator == "null" or initiator.startswith("file:")) and "url" in params:
            urls.append(params["url"])
    return [u for u in urls if u.startswith(("http://", "https://"))]


def load(page: Path, work: Path) -> Loaded:
    """Open the page in headless Chromium, network off; its DOM once its scripts have run."""
    browser = require_chromium()
    net_log = work / "net-log.json"
    cmd = [
        browser,
        *BROWSER_FLAGS,
        f"--user-data-dir={work / 'profile'}",
        f"--log-net-log={net_log}",
        "--dump-dom",
        page.as_uri(),
    ]
    # Its own process group: on a timeout the renderer and GPU processes go too.
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=LOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            # A page that calls alert() (say, markup that escaped escaping) waits for a
            # click that headless Chromium never gives.
            pytest.fail(
                f"{browser} took over {LOAD_TIMEOUT_S} s on {page.name}; a dialog "
                "(alert, confirm) in the page would block it",
                pytrace=False,
            )
    stderr = err.decode("utf-8", "replace")
    assert proc.returncode == 0, f"{browser} exited {proc.returncode}:\n{stderr[-3000:]}"
    dom_text = out.decode("utf-8")
    assert "</html>" in dom_text, f"no DOM dumped; stderr:\n{stderr[-3000:]}"
    return Loaded(Dom(dom_text), console_messages(stderr), page_requests(net_log))


# ---- the page's data ----


def restore(x):
    """The embedded block's data as the renderer got it: its strict JSON spells inf as a
    string."""
    if isinstance(x, str) and x in ("Infinity", "-Infinity", "NaN"):
        return float(x.lower().replace("infinity", "inf"))
    if isinstance(x, dict):
        return {k: restore(v) for k, v in x.items()}
    if isinstance(x, list):
        return [restore(v) for v in x]
    return x


def embedded(dom: Dom):
    def not_json(word):  # a bare Infinity or NaN: Python reads it, JSON.parse and jq do not
        raise AssertionError(f"the embedded data is not strict JSON: {word}")

    return restore(json.loads("".join(dom.by_id(DATA_ID).text), parse_constant=not_json))
