//! The names of the launcher contract under Kubernetes, shared by the adapters that read
//! a pod's environment (`kubernetes.rs`) and the manifests that set it (`manifest.rs`):
//! one name, one meaning, in both.

/// `launch.launcher` and `launch.port` as variables (the configuration's `IMGRUN_`
/// prefix, `__` between levels): a manifest names its kind and, where the launcher's own
/// port is fixed (a TrainJob's), the head's.
pub const LAUNCHER_VAR: &str = "IMGRUN_LAUNCH__LAUNCHER";
pub const PORT_VAR: &str = "IMGRUN_LAUNCH__PORT";

/// How many pods (launched processes) the job has: set by imgrun's Indexed Job and
/// JobSet manifests, whose pods have no such variable of their own.
pub const PROCESSES_VAR: &str = "IMGRUN_PROCESSES";
/// The head's address, `host` or `host:port` (process 0's pod: `<job>-0.<service>`).
pub const HEAD_VAR: &str = "IMGRUN_HEAD";
/// Under a JobSet of several replicated jobs: the pods of each (process = `JOB_INDEX` ×
/// this + `JOB_COMPLETION_INDEX`); absent, one job holds every pod.
pub const PODS_PER_JOB_VAR: &str = "IMGRUN_PODS_PER_JOB";

/// The join token, from the job's Secret: every process.
pub const TOKEN_VAR: &str = "IMGRUN_JOIN_TOKEN";
/// The hash of the cluster CA the others pin (`sha256:...`), from the Secret.
pub const CA_HASH_VAR: &str = "IMGRUN_CA_HASH";
/// The cluster CA's certificate and key (PEM), from the Secret: process 0's head serves
/// with them, so that its CA is the one the others pin.
pub const CA_CERT_VAR: &str = "IMGRUN_CA_CERT";
pub const CA_KEY_VAR: &str = "IMGRUN_CA_KEY";

/// The keys of the Secret that holds the four values above, in the same order.
pub const SECRET_TOKEN_KEY: &str = "token";
pub const SECRET_CA_HASH_KEY: &str = "ca-hash";
pub const SECRET_CA_CERT_KEY: &str = "ca.pem";
pub const SECRET_CA_KEY_KEY: &str = "ca-key.pem";

/// The head's UDP port when nothing names one (torchrun's and Kubeflow's default too).
pub const DEFAULT_PORT: u16 = 29400;

/// Set by Kubernetes in an Indexed Job's pods (JobSet's and TrainJob's included).
pub const COMPLETION_INDEX_VAR: &str = "JOB_COMPLETION_INDEX";
/// Set by JobSet in its pods.
pub const JOBSET_NAME_VAR: &str = "JOBSET_NAME";
pub const JOB_INDEX_VAR: &str = "JOB_INDEX";
/// Set in every pod: how a launch knows it runs under Kubernetes.
pub const IN_KUBERNETES_VAR: &str = "KUBERNETES_SERVICE_HOST";
