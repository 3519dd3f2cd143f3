"""Takes the README's screenshots of the dashboard in headless Chromium (Debian's
package), driven through its DevTools protocol (`tests/python/browser_check.py`'s
`headless_chromium`): opens the URL the head printed (the page trades its token for a
session cookie), then each page, and saves each as a PNG.

    dashboard_screenshots.py URL#token=TOKEN OUT_DIR NAME=PATH [NAME=PATH ...]

Each NAME=PATH saves OUT_DIR/dashboard-NAME.png of the page at PATH (relative to the
dashboard's root, e.g. `job=job/demo`). `tools/dashboard_screenshots.sh` runs it on a
cluster of its own.
"""

import base64
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from browser_check import headless_chromium  # noqa: E402

WIDTH, HEIGHT = 1280, 900


def main():
    url, out_dir, shots = sys.argv[1], sys.argv[2], sys.argv[3:]
    root = url.split("#", 1)[0]
    with headless_chromium("--hide-scrollbars") as call:
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


if __name__ == "__main__":
    main()
