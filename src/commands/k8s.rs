//! `imgrun k8s manifest`: the Kubernetes objects of a training job, written to standard
//! output (YAML, or JSON as a `v1` List) for `kubectl apply -f -`. The objects are
//! `runtime::launch::manifest`'s; this reads the flags, makes a fresh join secret and
//! renders them.

use std::process::ExitCode;

use anyhow::Context;
use runtime::launch::JoinSecret;
use runtime::launch::manifest::{
    DEFAULT_GRACE_SECS, ManifestKind, ManifestSpec, Node, manifest, to_yaml,
};
use runtime::launch::names::DEFAULT_PORT;

use crate::config::Loaded;

#[derive(Debug, clap::Subcommand)]
pub enum K8sCommand {
    /// Writes a training job's manifests: a Secret (join token and cluster CA, which the
    /// pods read as environment variables), then an Indexed Job with its headless Service
    /// (`--kind indexed-job`, the default), or a JobSet, a Kubeflow TrainJob or a
    /// PyTorchJob. Every pod runs `imgrun train` with the arguments after `--`.
    Manifest(ManifestArgs),
}

#[derive(Debug, clap::Args)]
pub struct ManifestArgs {
    /// The job's name: every object's, and the pods' DNS subdomain.
    #[arg(long, default_value = "imgrun")]
    name: String,
    /// The namespace of every object [default: kubectl's].
    #[arg(long)]
    namespace: Option<String>,
    /// indexed-job, jobset, trainjob or pytorchjob.
    #[arg(long, default_value = "indexed-job")]
    kind: ManifestKind,
    /// The container image; it must have `imgrun` on its PATH.
    #[arg(long)]
    image: String,
    /// How many pods, one `imgrun` process each.
    #[arg(long, default_value_t = 2)]
    pods: u32,
    /// GPUs per pod (`nvidia.com/gpu`): one trainer each. 0: CPU trainers.
    #[arg(long, default_value_t = 0)]
    gpus_per_pod: u32,
    /// CPU request per pod, a Kubernetes quantity (`8`, `7500m`).
    #[arg(long)]
    cpu: Option<String>,
    /// Memory request per pod (`64Gi`).
    #[arg(long)]
    memory: Option<String>,
    /// The head's UDP port (QUIC), declared on the pods.
    #[arg(long, default_value_t = DEFAULT_PORT)]
    port: u16,
    /// A Kueue LocalQueue: adds the `kueue.x-k8s.io/queue-name` label.
    #[arg(long)]
    queue: Option<String>,
    /// The pods' termination grace period: SIGTERM (preemption, a drain) checkpoints the
    /// step in flight within it. Give it more than a checkpoint takes.
    #[arg(long, default_value_t = DEFAULT_GRACE_SECS)]
    grace_secs: u32,
    /// `yaml`, or `json` (a `v1` List).
    #[arg(long, default_value = "yaml")]
    format: Format,
    /// The arguments of `imgrun train` in every pod.
    #[arg(last = true)]
    train_args: Vec<String>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Format {
    Yaml,
    Json,
}

pub fn run(_loaded: &Loaded, command: K8sCommand) -> anyhow::Result<ExitCode> {
    let K8sCommand::Manifest(args) = command;
    let spec = ManifestSpec {
        name: args.name,
        namespace: args.namespace,
        kind: args.kind,
        image: args.image,
        pods: args.pods,
        gpus_per_pod: args.gpus_per_pod,
        cpu: args.cpu,
        memory: args.memory,
        port: args.port,
        queue: args.queue,
        grace_secs: args.grace_secs,
        args: args.train_args,
    };
    let secret = JoinSecret::generate().context("making the job's join secret")?;
    let documents = manifest(&spec, &secret).context("imgrun k8s manifest")?;
    match args.format {
        Format::Yaml => print!("{}", to_yaml(&documents)),
        Format::Json => {
            let items: Vec<serde_json::Value> = documents.iter().map(Node::to_json).collect();
            let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
    }
    eprintln!(
        "imgrun k8s manifest: {} {} of {} pod(s); the Secret {}-join holds the cluster CA's \
         key: keep this output out of version control. Apply with `kubectl apply -f FILE`.",
        spec.kind.name(),
        spec.name,
        spec.pods,
        spec.name
    );
    Ok(ExitCode::SUCCESS)
}
