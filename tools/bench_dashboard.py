"""Measures the head's dashboard on a running job (run by tools/bench_dashboard.sh, which
starts the head and the job): what a first load of the job's page costs, how long after a
step's record lands in metrics.jsonl the page's change event arrives, and the head's CPU
and memory with no page open and with PAGES pages following the job.

    bench_dashboard.py URL TOKEN JOB RUN_DIR HEAD_PID SECONDS PAGES

Prints one figure a line. Standard library only.
"""

import http.client
import json
import os
import statistics
import sys
import threading
import time
import urllib.parse

url, token, job, run_dir, pid, seconds, pages = sys.argv[1:8]
seconds, pages, pid = float(seconds), int(pages), int(pid)
where = urllib.parse.urlparse(url)
auth = {"Authorization": f"Bearer {token}"}


def get(path):
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    conn.request("GET", path, headers=auth)
    body = conn.getresponse().read()
    conn.close()
    return body


def cpu_seconds():
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def head_load(span):
    before, start = cpu_seconds(), time.time()
    time.sleep(span)
    return 100 * (cpu_seconds() - before) / (time.time() - start)


# First load of the job's page: the page, its style and script, and its chart.
first = {p: len(get(p)) for p in [f"/job/{job}", "/style.css", "/app.js", f"/job/{job}/chart.svg"]}
print(f"first load of the job's page: {sum(first.values()) / 1024:.1f} KiB "
      + ", ".join(f"{p} {n / 1024:.1f} KiB" for p, n in first.items()))

idle_cpu, idle_rss = head_load(seconds), rss_mb()
print(f"head with no page open: {idle_cpu:.2f}% of a core, {idle_rss:.1f} MB resident")

# Step records as they land in metrics.jsonl, timed by polling the file.
landed = []
stop = threading.Event()


def watch_metrics():
    path = os.path.join(run_dir, "metrics.jsonl")
    offset = os.path.getsize(path)
    while not stop.is_set():
        size = os.path.getsize(path)
        if size > offset:
            now = time.time()
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read(size - offset)
            offset = size
            landed.extend(now for line in chunk.splitlines() if b'"kind":"step"' in line)
        time.sleep(0.005)


events = []


def follow(index):
    """One open page: its change stream, and the page fetched again at each event."""
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    conn.request("GET", "/events", headers=auth)
    stream = conn.getresponse()
    last_chart = 0.0
    while not stop.is_set():
        line = stream.fp.readline()
        if not line:
            return
        if line.startswith(b"data:"):
            if index == 0:
                events.append(time.time())
            get(f"/job/{job}")
            if time.time() - last_chart >= 5:
                last_chart = time.time()
                get(f"/job/{job}/chart.svg")


threads = [threading.Thread(target=watch_metrics, daemon=True)]
threads += [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(pages)]
for t in threads:
    t.start()
busy_cpu = head_load(seconds)
busy_rss = rss_mb()
stop.set()
print(f"head with {pages} pages following the job: {busy_cpu:.2f}% of a core, {busy_rss:.1f} MB resident")
print(f"dashboard's share: {busy_cpu - idle_cpu:+.2f}% of a core, {busy_rss - idle_rss:+.1f} MB")

# Each step record to the first change event after it.
delays = []
for at in landed:
    after = [e for e in events if e >= at]
    if after:
        delays.append(after[0] - at)
if delays:
    delays.sort()
    p95 = delays[min(len(delays) - 1, int(len(delays) * 0.95))]
    print(f"step record to change event: {len(delays)} steps, median {statistics.median(delays) * 1000:.0f} ms, "
          f"p95 {p95 * 1000:.0f} ms, max {delays[-1] * 1000:.0f} ms")
else:
    print("step record to change event: no steps seen")
