//! Kubernetes manifests for a training job (`imgrun k8s manifest`): a pure function from a
//! [`ManifestSpec`] and a [`JoinSecret`] to the objects `kubectl apply -f -` takes, and
//! [`to_yaml`] to print them. Every pod runs `imgrun train <args>` once, with all its GPUs;
//! process 0 starts the head on UDP `port`, the others join it by DNS name.
//!
//! - A Secret `<name>-join` holds the join token, the CA's hash, certificate and key;
//!   every container takes them as `secretKeyRef` variables ([`TOKEN_VAR`], [`CA_HASH_VAR`],
//!   [`CA_CERT_VAR`], [`CA_KEY_VAR`]), never as values in its args or env.
//! - Every container sets `IMGRUN_LAUNCH__LAUNCHER` to the kind's launcher, so that
//!   detection is explicit.
//! - `indexed-job`: a `batch/v1` Indexed Job and a headless Service of the same name that
//!   publishes pods before they are ready (the others resolve process 0 while it starts);
//!   [`PROCESSES_VAR`] and [`HEAD_VAR`] = `<name>-0.<name>:<port>`.
//! - `jobset`: a JobSet whose one replicated job, `node`, is that Indexed Job; JobSet makes
//!   the headless Service and sets the pods' subdomain; head `<name>-node-0-0.<name>:<port>`.
//! - `trainjob`: a Kubeflow Trainer v2 TrainJob on the `torch-distributed`
//!   ClusterTrainingRuntime, which sets `PET_NNODES`, `PET_NODE_RANK`, `PET_MASTER_ADDR`
//!   and `PET_MASTER_PORT`; `IMGRUN_LAUNCH__PORT` only for a port other than
//!   [`DEFAULT_PORT`]. The pods' labels and grace period go in as a runtime patch; neither
//!   the trainer API nor a patch can declare container ports, so this kind declares none.
//! - `pytorchjob`: a Training Operator v1 PyTorchJob, a Master and `pods - 1` Workers
//!   (none for one pod); the operator requires the container name `pytorch` and takes
//!   `MASTER_PORT` from the port named `pytorchjob-port`.
//! - All: `terminationGracePeriodSeconds` (the time to checkpoint after SIGTERM), a GPU
//!   limit, optional cpu and memory requests, the optional Kueue queue as a label of the
//!   workload object (not of the Service or the Secret), and the labels
//!   `app.kubernetes.io/name: imgrun` and `app.kubernetes.io/instance: <name>` on every
//!   object.
//! - Nothing but the head's UDP port is declared: no Service exposes anything else.
//!
//! The objects are [`Node`]s, whose mappings keep the order they were written in:
//! serde_json's `preserve_order` is off in this workspace, so a `serde_json::Value` would
//! sort every key (`name` last in a container). [`Node::to_json`] gives the JSON.
//!
//! The golden files `runtime/tests/data/k8s/<kind>.yaml` (and `<kind>.json`, the same
//! documents as JSON) are the output for fixed specs and a fixed secret. After a deliberate
//! change, rewrite them with `IMGRUN_UPDATE_GOLDEN=1 cargo test -p runtime --lib
//! launch::manifest`, then check them with `tests/python/k8s_validate.py` (its docstring
//! says how).

use std::str::FromStr;

use super::LauncherKind;
use super::names::{
    CA_CERT_VAR, CA_HASH_VAR, CA_KEY_VAR, DEFAULT_PORT, HEAD_VAR, LAUNCHER_VAR, PORT_VAR,
    PROCESSES_VAR, SECRET_CA_CERT_KEY, SECRET_CA_HASH_KEY, SECRET_CA_KEY_KEY, SECRET_TOKEN_KEY,
    TOKEN_VAR,
};
use super::secret::JoinSecret;

/// `terminationGracePeriodSeconds` when none is given: the time to checkpoint on SIGTERM.
pub const DEFAULT_GRACE_SECS: u32 = 120;

/// The Secret's variables and their keys.
const SECRET_VARS: [(&str, &str); 4] = [
    (TOKEN_VAR, SECRET_TOKEN_KEY),
    (CA_HASH_VAR, SECRET_CA_HASH_KEY),
    (CA_CERT_VAR, SECRET_CA_CERT_KEY),
    (CA_KEY_VAR, SECRET_CA_KEY_KEY),
];

/// A job name's longest: `<name>-node-0-0`, a JobSet pod's host name, stays a DNS label.
const MAX_NAME: usize = 52;
/// A DNS label's and a label value's longest.
const MAX_LABEL: usize = 63;
/// An Indexed Job's most completions.
const MAX_PODS: u32 = 100_000;
/// The replicated job of imgrun's JobSet, and of the TrainJob runtime's.
const NODE_JOB: &str = "node";
/// The ClusterTrainingRuntime a TrainJob runs on.
const TRAINJOB_RUNTIME: &str = "torch-distributed";

/// Which workload object runs the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ManifestKind {
    /// A `batch/v1` Indexed Job and a headless Service.
    #[default]
    IndexedJob,
    /// A JobSet (`jobset.x-k8s.io/v1alpha2`).
    JobSet,
    /// A Kubeflow Trainer v2 TrainJob (`trainer.kubeflow.org/v1alpha1`).
    TrainJob,
    /// A Kubeflow Training Operator v1 PyTorchJob (`kubeflow.org/v1`).
    PyTorchJob,
}

impl ManifestKind {
    pub const ALL: [Self; 4] = [
        Self::IndexedJob,
        Self::JobSet,
        Self::TrainJob,
        Self::PyTorchJob,
    ];

    /// The launcher its pods run under.
    pub fn launcher(self) -> LauncherKind {
        match self {
            Self::IndexedJob => LauncherKind::IndexedJob,
            Self::JobSet => LauncherKind::JobSet,
            Self::TrainJob => LauncherKind::TrainJob,
            Self::PyTorchJob => LauncherKind::PyTorchJob,
        }
    }

    /// Its name on the command line: its launcher's name.
    pub fn name(self) -> &'static str {
        self.launcher().name()
    }
}

impl FromStr for ManifestKind {
    type Err = ManifestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.name() == s)
            .ok_or_else(|| ManifestError::UnknownKind { name: s.to_owned() })
    }
}

/// What a training job's manifest says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestSpec {
    /// The job's name: every object's, and the pods' DNS subdomain.
    pub name: String,
    pub namespace: Option<String>,
    pub kind: ManifestKind,
    /// The container image, which has `imgrun` on its `PATH`.
    pub image: String,
    /// How many pods, one process each.
    pub pods: u32,
    /// `nvidia.com/gpu` per pod; 0 for none.
    pub gpus_per_pod: u32,
    /// Requests, as Kubernetes quantities (`8`, `500m`, `64Gi`).
    pub cpu: Option<String>,
    pub memory: Option<String>,
    /// The head's UDP port.
    pub port: u16,
    /// A Kueue LocalQueue.
    pub queue: Option<String>,
    pub grace_secs: u32,
    /// The arguments after `imgrun train`.
    pub args: Vec<String>,
}

impl ManifestSpec {
    /// An Indexed Job of `pods` pods without GPUs, with the default port and grace period.
    pub fn new(name: impl Into<String>, image: impl Into<String>, pods: u32) -> Self {
        Self {
            name: name.into(),
            namespace: None,
            kind: ManifestKind::default(),
            image: image.into(),
            pods,
            gpus_per_pod: 0,
            cpu: None,
            memory: None,
            port: DEFAULT_PORT,
            queue: None,
            grace_secs: DEFAULT_GRACE_SECS,
            args: Vec::new(),
        }
    }
}

/// Why no manifest: the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("unknown kind `{name}`: expected indexed-job, jobset, trainjob or pytorchjob")]
    UnknownKind { name: String },
    #[error("{field} {value:?}: {reason}")]
    Invalid {
        field: &'static str,
        value: String,
        reason: String,
    },
    #[error("the join secret has no CA: process 0's head serves with it")]
    NoCa,
}

/// A YAML (or JSON) value whose mappings keep their keys in the order written. A
/// manifest's Secret holds the join token and the CA's key: print it where the manifest
/// goes, never to a log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Bool(bool),
    Int(i64),
    Str(String),
    List(Vec<Node>),
    Map(Vec<(String, Node)>),
}

impl Node {
    pub fn map<'a>(entries: impl IntoIterator<Item = (&'a str, Node)>) -> Self {
        Self::Map(
            entries
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
        )
    }

    pub fn list<T: Into<Node>>(items: impl IntoIterator<Item = T>) -> Self {
        Self::List(items.into_iter().map(Into::into).collect())
    }

    /// The value of a mapping's `key`.
    pub fn get(&self, key: &str) -> Option<&Node> {
        match self {
            Self::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value;
        match self {
            Self::Bool(b) => Value::Bool(*b),
            Self::Int(i) => Value::from(*i),
            Self::Str(s) => Value::String(s.clone()),
            Self::List(items) => Value::Array(items.iter().map(Self::to_json).collect()),
            Self::Map(entries) => Value::Object(
                entries
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_json()))
                    .collect(),
            ),
        }
    }
}

impl From<&str> for Node {
    fn from(s: &str) -> Self {
        Self::Str(s.to_owned())
    }
}

impl From<String> for Node {
    fn from(s: String) -> Self {
        Self::Str(s)
    }
}

impl From<&String> for Node {
    fn from(s: &String) -> Self {
        Self::Str(s.clone())
    }
}

impl From<u32> for Node {
    fn from(n: u32) -> Self {
        Self::Int(n.into())
    }
}

impl From<u16> for Node {
    fn from(n: u16) -> Self {
        Self::Int(n.into())
    }
}

impl From<bool> for Node {
    fn from(b: bool) -> Self {
        Self::Bool(b)
    }
}

/// The objects of `spec`'s job: the Secret, the Service (`indexed-job` only), then the
/// workload.
pub fn manifest(spec: &ManifestSpec, secret: &JoinSecret) -> Result<Vec<Node>, ManifestError> {
    check(spec)?;
    let mut documents = vec![secret_object(spec, secret)?];
    match spec.kind {
        ManifestKind::IndexedJob => {
            documents.push(service(spec));
            documents.push(indexed_job(spec));
        }
        ManifestKind::JobSet => documents.push(jobset(spec)),
        ManifestKind::TrainJob => documents.push(trainjob(spec)),
        ManifestKind::PyTorchJob => documents.push(pytorchjob(spec)),
    }
    Ok(documents)
}

/// `documents` as one YAML stream, each after a `---` line: block mappings and sequences,
/// keys in their order, strings plain where YAML reads them back as the same string and
/// double-quoted otherwise, strings of several lines as `|` literal blocks.
pub fn to_yaml(documents: &[Node]) -> String {
    let mut out = String::new();
    for document in documents {
        out.push_str("---");
        match document {
            Node::Map(entries) if !entries.is_empty() => {
                out.push('\n');
                write_map(&mut out, entries, 0);
            }
            Node::List(items) if !items.is_empty() => {
                out.push('\n');
                write_list(&mut out, items, 0);
            }
            scalar => write_value(&mut out, scalar, 0),
        }
    }
    out
}

/// Refuses what Kubernetes (or the pods' DNS names) would, naming the field.
fn check(spec: &ManifestSpec) -> Result<(), ManifestError> {
    let invalid = |field, value: &str, reason: &str| {
        Err(ManifestError::Invalid {
            field,
            value: value.to_owned(),
            reason: reason.to_owned(),
        })
    };
    if !is_dns_label(&spec.name, true) || spec.name.len() > MAX_NAME {
        let reason = "not a DNS-1035 label of at most 52 characters (a-z, 0-9 and '-', \
                      starting with a letter)";
        return invalid("name", &spec.name, reason);
    }
    if let Some(namespace) = &spec.namespace
        && !is_dns_label(namespace, false)
    {
        return invalid("namespace", namespace, "not a DNS-1123 label");
    }
    let blank = |c: char| c.is_whitespace() || c.is_control();
    if spec.image.is_empty() || spec.image.chars().any(blank) {
        return invalid("image", &spec.image, "empty or has blanks");
    }
    if spec.pods == 0 || spec.pods > MAX_PODS {
        return invalid("pods", &spec.pods.to_string(), "not between 1 and 100000");
    }
    if spec.port == 0 {
        return invalid("port", "0", "the head needs a fixed port");
    }
    if let Some(queue) = &spec.queue
        && !is_label_value(queue)
    {
        return invalid("queue", queue, "not a label value (at most 63 characters)");
    }
    for (field, quantity) in [("cpu", &spec.cpu), ("memory", &spec.memory)] {
        if let Some(quantity) = quantity
            && !is_quantity(quantity)
        {
            return invalid(field, quantity, "not a quantity such as 8, 500m or 64Gi");
        }
    }
    let host = longest_host(spec);
    if host.len() > MAX_LABEL {
        let reason = format!("the pod host name `{host}` is longer than 63 characters");
        return invalid("name", &spec.name, &reason);
    }
    Ok(())
}

/// The longest host name among the pods: a DNS label.
fn longest_host(spec: &ManifestSpec) -> String {
    let (name, last) = (&spec.name, spec.pods - 1);
    match spec.kind {
        ManifestKind::IndexedJob => format!("{name}-{last}"),
        ManifestKind::JobSet | ManifestKind::TrainJob => format!("{name}-{NODE_JOB}-0-{last}"),
        ManifestKind::PyTorchJob if last == 0 => format!("{name}-master-0"),
        ManifestKind::PyTorchJob => format!("{name}-worker-{}", last - 1),
    }
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?` of at most 63 characters; DNS-1035 (`letter_first`)
/// also starts with a letter.
fn is_dns_label(s: &str, letter_first: bool) -> bool {
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    s.len() <= MAX_LABEL
        && s.chars().all(allowed)
        && s.starts_with(|c: char| c.is_ascii_lowercase() || (!letter_first && c.is_ascii_digit()))
        && !s.ends_with('-')
}

/// A non-empty label value: `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, at most 63.
fn is_label_value(s: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    s.len() <= MAX_LABEL
        && s.chars().all(allowed)
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// A Kubernetes quantity without sign or exponent: a decimal number and a suffix.
fn is_quantity(s: &str) -> bool {
    const SUFFIXES: [&str; 16] = [
        "", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei",
    ];
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    number.chars().any(|c| c.is_ascii_digit())
        && number.matches('.').count() <= 1
        && SUFFIXES.contains(&suffix)
}

fn secret_name(spec: &ManifestSpec) -> String {
    format!("{}-join", spec.name)
}

/// `metadata`: the name, the namespace, the labels (and the queue's, for a workload).
fn metadata(spec: &ManifestSpec, name: &str, workload: bool) -> Node {
    let mut entries = vec![("name", name.into())];
    if let Some(namespace) = &spec.namespace {
        entries.push(("namespace", namespace.into()));
    }
    let mut labels = app_labels(spec);
    if workload && let Some(queue) = &spec.queue {
        labels.push(("kueue.x-k8s.io/queue-name", queue.into()));
    }
    entries.push(("labels", Node::map(labels)));
    Node::map(entries)
}

/// A pod template's or a job template's `metadata`: the labels.
fn pod_metadata(spec: &ManifestSpec) -> Node {
    Node::map([("labels", Node::map(app_labels(spec)))])
}

fn app_labels(spec: &ManifestSpec) -> Vec<(&'static str, Node)> {
    vec![
        ("app.kubernetes.io/name", "imgrun".into()),
        ("app.kubernetes.io/instance", (&spec.name).into()),
    ]
}

fn object(api_version: &str, kind: &str, metadata: Node, body: Vec<(&str, Node)>) -> Node {
    let head = [
        ("apiVersion", api_version.into()),
        ("kind", kind.into()),
        ("metadata", metadata),
    ];
    Node::map(head.into_iter().chain(body))
}

/// `inner` under the chain of single-key mappings `keys`, outermost first.
fn nest(keys: &[&str], inner: Node) -> Node {
    keys.iter()
        .rev()
        .fold(inner, |node, key| Node::map([(*key, node)]))
}

fn secret_object(spec: &ManifestSpec, secret: &JoinSecret) -> Result<Node, ManifestError> {
    let ca = secret.ca.as_ref().ok_or(ManifestError::NoCa)?;
    let data = Node::map([
        (SECRET_TOKEN_KEY, (&secret.token).into()),
        (SECRET_CA_HASH_KEY, (&secret.ca_hash).into()),
        (SECRET_CA_CERT_KEY, (&ca.cert).into()),
        (SECRET_CA_KEY_KEY, (&ca.key).into()),
    ]);
    let metadata = metadata(spec, &secret_name(spec), false);
    let body = vec![("type", "Opaque".into()), ("stringData", data)];
    Ok(object("v1", "Secret", metadata, body))
}

/// The headless Service that gives an Indexed Job's pods their DNS names.
fn service(spec: &ManifestSpec) -> Node {
    let port = Node::map([
        ("name", "imgrun".into()),
        ("protocol", "UDP".into()),
        ("port", spec.port.into()),
    ]);
    let body = Node::map([
        ("clusterIP", "None".into()),
        ("publishNotReadyAddresses", true.into()),
        (
            "selector",
            Node::map([("batch.kubernetes.io/job-name", (&spec.name).into())]),
        ),
        ("ports", Node::List(vec![port])),
    ]);
    object(
        "v1",
        "Service",
        metadata(spec, &spec.name, false),
        vec![("spec", body)],
    )
}

fn indexed_job(spec: &ManifestSpec) -> Node {
    let pod = vec![
        ("subdomain", (&spec.name).into()),
        ("restartPolicy", "Never".into()),
    ];
    let metadata = metadata(spec, &spec.name, true);
    object(
        "batch/v1",
        "Job",
        metadata,
        vec![("spec", job_spec(spec, pod))],
    )
}

fn jobset(spec: &ManifestSpec) -> Node {
    // JobSet sets the pods' subdomain itself.
    let pod = vec![("restartPolicy", "Never".into())];
    let job = Node::map([
        ("name", NODE_JOB.into()),
        ("replicas", 1u32.into()),
        (
            "template",
            Node::map([
                ("metadata", pod_metadata(spec)),
                ("spec", job_spec(spec, pod)),
            ]),
        ),
    ]);
    let network = Node::map([
        ("enableDNSHostnames", true.into()),
        ("subdomain", (&spec.name).into()),
        ("publishNotReadyAddresses", true.into()),
    ]);
    let body = Node::map([
        ("network", network),
        ("replicatedJobs", Node::List(vec![job])),
    ]);
    let metadata = metadata(spec, &spec.name, true);
    object(
        "jobset.x-k8s.io/v1alpha2",
        "JobSet",
        metadata,
        vec![("spec", body)],
    )
}

fn trainjob(spec: &ManifestSpec) -> Node {
    let runtime = Node::map([
        ("apiGroup", "trainer.kubeflow.org".into()),
        ("kind", "ClusterTrainingRuntime".into()),
        ("name", TRAINJOB_RUNTIME.into()),
    ]);
    let mut trainer = vec![
        ("image", (&spec.image).into()),
        ("command", command()),
        ("args", Node::list(&spec.args)),
        ("env", env(spec)),
        ("numNodes", spec.pods.into()),
    ];
    if let Some(resources) = resources(spec) {
        trainer.push(("resourcesPerNode", resources));
    }
    // What the trainer API cannot say: the pods' labels and grace period.
    let pod = Node::map([
        ("metadata", pod_metadata(spec)),
        (
            "spec",
            Node::map([("terminationGracePeriodSeconds", spec.grace_secs.into())]),
        ),
    ]);
    let job = Node::map([
        ("name", NODE_JOB.into()),
        ("template", nest(&["spec", "template"], pod)),
    ]);
    let patch = Node::map([
        ("manager", "imgrun".into()),
        (
            "trainingRuntimeSpec",
            nest(
                &["template", "spec", "replicatedJobs"],
                Node::List(vec![job]),
            ),
        ),
    ]);
    let body = Node::map([
        ("runtimeRef", runtime),
        ("trainer", Node::map(trainer)),
        ("runtimePatches", Node::List(vec![patch])),
    ]);
    let metadata = metadata(spec, &spec.name, true);
    object(
        "trainer.kubeflow.org/v1alpha1",
        "TrainJob",
        metadata,
        vec![("spec", body)],
    )
}

fn pytorchjob(spec: &ManifestSpec) -> Node {
    // The operator sets the pods' restart policy from the replica's.
    let replica = |replicas: u32| {
        Node::map([
            ("replicas", replicas.into()),
            ("restartPolicy", "Never".into()),
            ("template", pod_template(spec, Vec::new())),
        ])
    };
    let mut replicas = vec![("Master", replica(1))];
    if spec.pods > 1 {
        replicas.push(("Worker", replica(spec.pods - 1)));
    }
    let body = Node::map([("pytorchReplicaSpecs", Node::map(replicas))]);
    let metadata = metadata(spec, &spec.name, true);
    object(
        "kubeflow.org/v1",
        "PyTorchJob",
        metadata,
        vec![("spec", body)],
    )
}

/// An Indexed Job's spec of one pod per process; `pod`: the pod spec's first entries.
fn job_spec(spec: &ManifestSpec, pod: Vec<(&'static str, Node)>) -> Node {
    Node::map([
        ("completionMode", "Indexed".into()),
        ("completions", spec.pods.into()),
        ("parallelism", spec.pods.into()),
        ("backoffLimit", 0u32.into()),
        ("template", pod_template(spec, pod)),
    ])
}

/// A pod template whose spec starts with `pod`, then the grace period and the container.
fn pod_template(spec: &ManifestSpec, pod: Vec<(&'static str, Node)>) -> Node {
    let tail = [
        ("terminationGracePeriodSeconds", spec.grace_secs.into()),
        ("containers", Node::List(vec![container(spec)])),
    ];
    Node::map([
        ("metadata", pod_metadata(spec)),
        ("spec", Node::map(pod.into_iter().chain(tail))),
    ])
}

fn container(spec: &ManifestSpec) -> Node {
    // The Training Operator finds its container and its port by these names.
    let (name, port_name) = match spec.kind {
        ManifestKind::PyTorchJob => ("pytorch", "pytorchjob-port"),
        _ => ("imgrun", "imgrun"),
    };
    let port = Node::map([
        ("name", port_name.into()),
        ("containerPort", spec.port.into()),
        ("protocol", "UDP".into()),
    ]);
    let mut entries = vec![
        ("name", name.into()),
        ("image", (&spec.image).into()),
        ("command", command()),
        ("args", Node::list(&spec.args)),
        ("env", env(spec)),
        ("ports", Node::List(vec![port])),
    ];
    if let Some(resources) = resources(spec) {
        entries.push(("resources", resources));
    }
    Node::map(entries)
}

fn command() -> Node {
    Node::list(["imgrun", "train"])
}

/// The GPU limit and the cpu and memory requests, if any.
fn resources(spec: &ManifestSpec) -> Option<Node> {
    let mut entries = Vec::new();
    if spec.gpus_per_pod > 0 {
        let gpus = Node::map([("nvidia.com/gpu", spec.gpus_per_pod.into())]);
        entries.push(("limits", gpus));
    }
    let requests: Vec<(&str, Node)> = [("cpu", &spec.cpu), ("memory", &spec.memory)]
        .into_iter()
        .filter_map(|(name, quantity)| Some((name, quantity.as_ref()?.into())))
        .collect();
    if !requests.is_empty() {
        entries.push(("requests", Node::map(requests)));
    }
    (!entries.is_empty()).then(|| Node::map(entries))
}

/// The container's variables: the launcher, what the kind does not set itself, then the
/// Secret's.
fn env(spec: &ManifestSpec) -> Node {
    let value =
        |name: &str, value: String| Node::map([("name", name.into()), ("value", value.into())]);
    let mut vars = vec![value(LAUNCHER_VAR, spec.kind.name().to_owned())];
    match spec.kind {
        ManifestKind::IndexedJob | ManifestKind::JobSet => {
            let head_pod = match spec.kind {
                ManifestKind::JobSet => format!("{}-{NODE_JOB}-0-0", spec.name),
                _ => format!("{}-0", spec.name),
            };
            vars.push(value(PROCESSES_VAR, spec.pods.to_string()));
            let head = format!("{head_pod}.{}:{}", spec.name, spec.port);
            vars.push(value(HEAD_VAR, head));
        }
        ManifestKind::TrainJob if spec.port != DEFAULT_PORT => {
            vars.push(value(PORT_VAR, spec.port.to_string()));
        }
        ManifestKind::TrainJob | ManifestKind::PyTorchJob => {}
    }
    let secret = secret_name(spec);
    for (name, key) in SECRET_VARS {
        let reference = Node::map([("name", (&secret).into()), ("key", key.into())]);
        let from = Node::map([("secretKeyRef", reference)]);
        vars.push(Node::map([("name", name.into()), ("valueFrom", from)]));
    }
    Node::List(vars)
}

fn write_map(out: &mut String, entries: &[(String, Node)], indent: usize) {
    for (key, value) in entries {
        pad(out, indent);
        out.push_str(&scalar(key));
        out.push(':');
        write_value(out, value, indent);
    }
}

fn write_list(out: &mut String, items: &[Node], indent: usize) {
    for item in items {
        match item {
            Node::Map(entries) if !entries.is_empty() => {
                let mut nested = String::new();
                write_map(&mut nested, entries, indent + 2);
                // The first line's indentation ends in "- " rather than two spaces.
                nested.replace_range(indent..indent + 2, "- ");
                out.push_str(&nested);
            }
            Node::List(inner) if !inner.is_empty() => {
                let mut nested = String::new();
                write_list(&mut nested, inner, indent + 2);
                nested.replace_range(indent..indent + 2, "- ");
                out.push_str(&nested);
            }
            _ => {
                pad(out, indent);
                out.push('-');
                write_value(out, item, indent);
            }
        }
    }
}

/// `node` after a `key:` or a `-` at `indent`: a scalar on the same line, a literal block
/// or a non-empty collection on the lines below, indented two more.
fn write_value(out: &mut String, node: &Node, indent: usize) {
    match node {
        Node::Map(entries) if !entries.is_empty() => {
            out.push('\n');
            write_map(out, entries, indent + 2);
        }
        Node::List(items) if !items.is_empty() => {
            out.push('\n');
            write_list(out, items, indent + 2);
        }
        Node::Str(text) if is_literal_block(text) => {
            // Clip keeps one final line break, strip none.
            out.push_str(if text.ends_with('\n') {
                " |\n"
            } else {
                " |-\n"
            });
            for line in text.strip_suffix('\n').unwrap_or(text).split('\n') {
                if !line.is_empty() {
                    pad(out, indent + 2);
                    out.push_str(line);
                }
                out.push('\n');
            }
        }
        _ => {
            out.push(' ');
            out.push_str(&inline(node));
            out.push('\n');
        }
    }
}

/// Whether `text` reads back the same as a literal block: several lines of printable
/// ASCII, the first neither empty nor indented (which would need an indentation
/// indicator), at most one final line break (more would need keep chomping).
fn is_literal_block(text: &str) -> bool {
    text.contains('\n')
        && text
            .chars()
            .all(|c| c == '\n' || c.is_ascii_graphic() || c == ' ')
        && !text.starts_with([' ', '\n'])
        && !text.ends_with("\n\n")
}

/// `node` on one line (flow style for a collection).
fn inline(node: &Node) -> String {
    match node {
        Node::Bool(b) => b.to_string(),
        Node::Int(i) => i.to_string(),
        Node::Str(text) => scalar(text),
        Node::List(items) => {
            let items: Vec<String> = items.iter().map(inline).collect();
            format!("[{}]", items.join(", "))
        }
        Node::Map(entries) => {
            let entries: Vec<String> = entries
                .iter()
                .map(|(k, v)| format!("{}: {}", scalar(k), inline(v)))
                .collect();
            format!("{{{}}}", entries.join(", "))
        }
    }
}

/// `text` as a plain scalar where YAML (1.1 or 1.2) reads it back as that string: a
/// letter, then letters, digits and `-_./`, and not a boolean or null word. Otherwise
/// double-quoted: JSON's escapes, and every character outside printable ASCII escaped
/// (`\u`, or `\U` past U+FFFF), since YAML reads some of them as line breaks.
fn scalar(text: &str) -> String {
    const WORDS: [&str; 9] = ["true", "false", "yes", "no", "on", "off", "y", "n", "null"];
    let plain = text.starts_with(|c: char| c.is_ascii_alphabetic())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && !WORDS.contains(&text.to_ascii_lowercase().as_str());
    if plain {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            ' '..='~' => out.push(c),
            c if u32::from(c) <= 0xffff => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push_str(&format!("\\U{:08x}", u32::from(c))),
        }
    }
    out.push('"');
    out
}

fn pad(out: &mut String, indent: usize) {
    out.extend(std::iter::repeat_n(' ', indent));
}

#[cfg(test)]
#[path = "manifest_tests.rs"]
mod tests;
