"""Opens a dashboard page in headless Chromium through the DevTools protocol, as a user
opens the URL the head printed, and prints as JSON what the page shows: once it settled
(`first`), and again `later` seconds after (`second`), with whether it is still the same
document (updated in place by the server's change events, not reloaded) and whether its
chart image loaded.

    browser_check.py URL SETTLE_SECONDS LATER_SECONDS

`headless_chromium` is also what `tools/dashboard_screenshots.py` drives.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket


@contextlib.contextmanager
def headless_chromium(*flags):
    """Starts headless Chromium with a profile of its own and yields a function that
    calls one DevTools method of its page and returns the result; kills it and removes
    its profile at the end."""
    profile = tempfile.mkdtemp(prefix="imgrun-chromium-")
    browser = subprocess.Popen(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            *flags,
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "about:blank",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield devtools(profile)
    finally:
        browser.kill()
        browser.wait()
        shutil.rmtree(profile, ignore_errors=True)


def devtools(profile):
    """A function that calls one DevTools method of the page of the browser whose profile
    is `profile`."""
    port_file = os.path.join(profile, "DevToolsActivePort")
    deadline = time.time() + 30
    while not os.path.exists(port_file) or not open(port_file).read().strip():
        if time.time() > deadline:
            sys.exit("chromium did not open its DevTools port in 30 s")
        time.sleep(0.1)
    port = open(port_file).read().split()[0]
    targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
    page = next(t for t in targets if t["type"] == "page")
    ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
    calls = [0]

    def call(method, **params):
        calls[0] += 1
        ws.send(json.dumps({"id": calls[0], "method": method, "params": params}))
        while True:
            reply = json.loads(ws.recv())
            if reply.get("id") == calls[0]:
                if "error" in reply:
                    sys.exit(f"{method}: {reply['error']}")
                return reply["result"]

    return call


def main():
    url, settle, later = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    with headless_chromium() as call:

        def evaluate(expression):
            return call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

        call("Page.navigate", url=url)
        time.sleep(settle)
        first = evaluate("document.body.innerText")
        evaluate("window.imgrunMarker = 1")
        time.sleep(later)
        second = evaluate("document.body.innerText")
        same_document = evaluate("window.imgrunMarker === 1")
        # The page replaces its body in place at each change, its chart with it: the
        # chart counts as shown once a drawn one is there, within 10 s.
        width = "(() => { const i = document.querySelector('img.chart'); return i ? i.naturalWidth : null })()"
        chart = evaluate(width)
        deadline = time.monotonic() + 10
        while not chart and time.monotonic() < deadline:
            time.sleep(0.2)
            chart = evaluate(width)
        print(json.dumps({"first": first, "second": second, "same_document": same_document, "chart_width": chart}))


if __name__ == "__main__":
    main()
