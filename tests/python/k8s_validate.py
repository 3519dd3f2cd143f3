"""Checks Kubernetes manifests (`imgrun k8s manifest`'s YAML) offline, document by document:

- round trip: the file loads with `yaml.safe_load_all` to JSON values only (strings,
  integers, booleans, lists, mappings with string keys: no date, float or null from a
  misread scalar); where FILE.json sits beside FILE.yaml (the golden files), the documents
  equal it, types included;
- Secret, Service and Job (any kind Kubernetes has built in): PyPI `kubernetes-validate`'s
  strict schemas of Kubernetes KUBERNETES_VERSION, where an unknown field fails (it stops
  at a document's first failure);
- JobSet, TrainJob and PyTorchJob: `check-jsonschema` against the CRD's `openAPIV3Schema`
  in runtime/tests/data/k8s/crds/ (as the projects publish it, see the README there), and
  then a walk that fails on any field the schema does not name. The CRDs leave
  `additionalProperties` unset, which JSON Schema reads as "anything goes" while the API
  server silently drops the unknown field: a misspelt field would vanish. The objects'
  `metadata` (a bare `type: object` in a CRD) is checked as a ConfigMap's, strictly.

    python=$(tools/pytools.sh)
    $python tests/python/k8s_validate.py runtime/tests/data/k8s/{indexed-job,jobset,trainjob,pytorchjob}.yaml
    $python tests/python/k8s_validate.py --round-trip-only runtime/tests/data/k8s/scalars.yaml

Exits 1 naming the file and the document of each failure; 0 with a one-line summary.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import kubernetes_validate
import yaml

# The oldest Kubernetes the manifests are for (Indexed Jobs' `batch.kubernetes.io/job-name`
# label is 1.27's): a field newer than this fails.
KUBERNETES_VERSION = "1.30.0"
CRDS = Path(__file__).resolve().parents[2] / "runtime" / "tests" / "data" / "k8s" / "crds"
# (apiVersion, kind) -> the CRD's schema.
CRD_SCHEMAS = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): CRDS / "jobset.schema.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): CRDS / "trainjob.schema.json",
    ("kubeflow.org/v1", "PyTorchJob"): CRDS / "pytorchjob.schema.json",
}


def json_types(value, path="$"):
    """Paths in `value` that hold something JSON has not."""
    if isinstance(value, dict):
        bad = [f"{path} has key {k!r}" for k in value if not isinstance(k, str)]
        for k, v in value.items():
            bad += json_types(v, f"{path}.{k}")
        return bad
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in json_types(v, f"{path}[{i}]")]
    if isinstance(value, (str, bool, int)):
        return []
    return [f"{path} is {type(value).__name__} {value!r}"]


def difference(got, want, path="$"):
    """The first path where `got` and `want` differ, types included, or None."""
    if type(got) is not type(want):
        return f"{path}: {got!r}, not {want!r}"
    if isinstance(got, dict):
        for k in sorted(set(got) | set(want)):
            if k not in got or k not in want:
                return f"{path}.{k}: only in {'the YAML' if k in got else 'the JSON'}"
            if found := difference(got[k], want[k], f"{path}.{k}"):
                return found
        return None
    if isinstance(got, list):
        if len(got) != len(want):
            return f"{path}: {len(got)} items, not {len(want)}"
        return next(filter(None, (difference(g, w, f"{path}[{i}]") for i, (g, w) in enumerate(zip(got, want)))), None)
    return None if got == want else f"{path}: {got!r}, not {want!r}"


def unknown_fields(value, schema, path):
    """Paths in `value` that `schema` (a CRD's structural schema) does not name."""
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [p for i, v in enumerate(value) for p in unknown_fields(v, schema["items"], f"{path}[{i}]")]
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    properties = schema.get("properties")
    if properties is None:
        extra = schema.get("additionalProperties")
        if not isinstance(extra, dict):
            return []
        return [p for k, v in value.items() for p in unknown_fields(v, extra, f"{path}.{k}")]
    bad = []
    for k, v in value.items():
        if k not in properties:
            bad.append(f"{path}.{k} is not a field of the schema")
        else:
            bad += unknown_fields(v, properties[k], f"{path}.{k}")
    return bad


def check_builtin(document):
    """Failures of a built-in kind under kubernetes-validate's strict schemas."""
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        return [f"${where}: {error.message}"]
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.utils.VersionNotSupportedError) as error:
        return [error.message]
    return []


def check_crds(documents, workdir):
    """Failures of CRD kinds, by (file, document index): check-jsonschema, then the walk."""
    failures, by_schema, schemas = {}, {}, {}
    for n, ((name, index), document) in enumerate(documents.items()):
        schema_path = CRD_SCHEMAS[(document.get("apiVersion"), document.get("kind"))]
        instance = Path(workdir) / f"{n}-{Path(name).stem}.document-{index}.json"
        instance.write_text(json.dumps(document))
        by_schema.setdefault(schema_path, []).append(((name, index), instance))
        schema = schemas.setdefault(schema_path, json.loads(schema_path.read_text()))
        metadata = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": document.get("metadata")}
        bad = unknown_fields({k: v for k, v in document.items() if k != "metadata"}, schema, "$")
        bad += check_builtin(metadata)
        if bad:
            failures[(name, index)] = bad
    for schema_path, instances in by_schema.items():
        command = [sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema_path)]
        run = subprocess.run(command + [str(i) for _, i in instances], capture_output=True, text=True)
        if run.returncode == 0:
            continue
        output = [line.strip() for line in run.stdout.splitlines()]
        for key, instance in instances:
            prefix = f"{instance}::"
            lines = [line[len(prefix) :] for line in output if line.startswith(prefix)]
            failures.setdefault(key, []).extend(f"{line} (check-jsonschema)" for line in lines)
        if not any(line.startswith(str(workdir)) for line in output):
            raise SystemExit(f"check-jsonschema failed unexpectedly:\n{run.stdout}{run.stderr}")
    failures = {key: messages for key, messages in failures.items() if messages}
    return failures


def load(path):
    """The file's documents, and its round-trip failures by document index (None: the file)."""
    try:
        documents = list(yaml.safe_load_all(Path(path).read_text()))
    except yaml.YAMLError as error:
        return [], {None: [f"not YAML: {error}"]}
    failures = {}
    for index, document in enumerate(documents):
        bad = json_types(document)
        if bad:
            failures[index] = [f"not JSON: {b}" for b in bad]
    golden = Path(path).with_suffix(".json")
    if golden.exists() and not failures:
        want = json.loads(golden.read_text())
        if len(want) != len(documents):
            failures[None] = [f"{len(documents)} documents, {golden.name} has {len(want)}"]
        for index, (got, expected) in enumerate(zip(documents, want)):
            if found := difference(got, expected):
                failures[index] = [f"reads back other than {golden.name}'s document {index}: {found}"]
    return documents, failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trip-only", action="store_true", help="only check that the files read back")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    failures, crd_documents, count = {}, {}, 0
    for name in args.files:
        documents, bad = load(name)
        count += len(documents)
        failures.update({(name, index): messages for index, messages in bad.items()})
        if args.round_trip_only or bad:
            continue
        for index, document in enumerate(documents):
            key = (document.get("apiVersion"), document.get("kind"))
            if key in CRD_SCHEMAS:
                crd_documents[(name, index)] = document
            elif messages := check_builtin(document):
                failures[(name, index)] = messages
    with tempfile.TemporaryDirectory() as workdir:
        for key, messages in check_crds(crd_documents, workdir).items():
            failures.setdefault(key, []).extend(messages)
    for (name, index), messages in sorted(failures.items(), key=lambda f: (f[0][0], -1 if f[0][1] is None else f[0][1])):
        where = name if index is None else f"{name}: document {index}"
        for message in messages:
            print(f"{where}: {message}")
    if failures:
        print(f"k8s_validate: {len(failures)} failed, of {count} documents in {len(args.files)} files", file=sys.stderr)
        sys.exit(1)
    checks = "read back" if args.round_trip_only else f"valid (Kubernetes {KUBERNETES_VERSION}, CRDs)"
    print(f"k8s_validate: {count} documents in {len(args.files)} files {checks}")


if __name__ == "__main__":
    main()
