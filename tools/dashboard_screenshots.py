"""Takes the README's screenshots of the dashboard in headless Chromium (Debian's
package), driven through its DevTools protocol: opens the URL the head printed (the page
trades its token for a session cookie), then each page, and saves each as a PNG.

    dashboard_screenshots.py URL#token=TOKEN OUT_DIR NAME=PATH [NAME=PATH ...]

Each NAME=PATH saves OUT_DIR/dashboard-NAME.png of the page at PATH (relative to the
dashboard's root, e.g. `job=job/demo`). `tools/dashboard_screenshots.sh` runs it on a
cluster of its own.
"""

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket

WIDTH, HEIGHT = 1280, 900


def main():
    url, out_dir, shots = sys.argv[1], sys.argv[2], sys.argv[3:]
    root = url.split("#", 1)[0]
    profile = tempfile.mkdtemp(prefix="imgrun-chromium-")
    browser = subprocess.Popen(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "about:blank",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        call = devtools(profile)
        call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT,
             deviceScaleFactor=1, mobile=False)
        call("Page.navigate", url=url)
        time.sleep(4)
        for shot in shots:
            name, path = shot.split("=", 1)
            call("Page.navigate", url=root + path)
            time.sleep(3)
            image = call("Page.captureScreenshot", format="png")["data"]
            target = os.path.join(out_dir, f"dashboard-{name}.png")
            with open(target, "wb") as out:
                out.write(base64.b64decode(image))
            print(target)
    finally:
        browser.kill()
        browser.wait()


def devtools(profile):
    """A function that calls one DevTools method of the browser's page and returns its
    result."""
    port_file = os.path.join(profile, "DevToolsActivePort")
    deadline = time.time() + 30
    while not os.path.exists(port_file) or not open(port_file).read().strip():
        if time.time() > deadline:
            sys.exit("chromium did not open its DevTools port in 30 s")
        time.sleep(0.1)
    port = open(port_file).read().split()[0]
    targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
    page = next(t for t in targets if t["type"] == "page")
    ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30,
                                     suppress_origin=True)
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


if __name__ == "__main__":
    main()
