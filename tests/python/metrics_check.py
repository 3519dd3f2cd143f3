"""Parses an OpenMetrics exposition (the dashboard's `/metrics`) from standard input with
the parser of PyPI `prometheus-client`, which raises on anything malformed, and prints
every sample as JSON: [name, labels, value]."""

import json
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families

samples = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for sample in family.samples:
        samples.append([sample.name, sample.labels, sample.value])
json.dump(samples, sys.stdout)
