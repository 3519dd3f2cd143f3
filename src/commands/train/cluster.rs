//! The cluster a job runs on: the running one, or one embedded in this process for the
//! length of the job.

use anyhow::Context;
use runtime::ClusterClient;

use super::JobOptions;
use crate::config::Config;

/// The cluster a job runs on: the running one, or one embedded in this process.
pub(super) struct Cluster {
    pub(super) client: ClusterClient,
    pub(super) embedded: Option<(runtime::Head, tempfile::TempDir)>,
    /// Under a launcher: process 0's, which stops the other processes at the end.
    launched: Option<Launched>,
}

/// Process 0 of a launch: the rendezvous file the other processes joined through, if they
/// did not join with the join secret of the environment.
struct Launched {
    rendezvous: Option<std::path::PathBuf>,
}

impl Cluster {
    pub(super) async fn connect(config: &Config, options: &JobOptions) -> anyhow::Result<Self> {
        if let Some(launch) = &options.launch {
            let led = super::launch::lead(config, launch).await?;
            return Ok(Self {
                client: led.client,
                embedded: Some((led.head, led.dir)),
                launched: Some(Launched {
                    rendezvous: led.rendezvous,
                }),
            });
        }
        let state = crate::commands::cluster::state_dir(&config.cluster)?;
        if !options.embedded {
            match ClusterClient::connect(&state, options.address.as_deref()).await {
                Ok(client) => {
                    println!("cluster: head at {}", client.head());
                    return Ok(Self {
                        client,
                        embedded: None,
                        launched: None,
                    });
                }
                Err(runtime::DaemonError::NoHead { .. }) if options.address.is_none() => {}
                Err(error) => {
                    return Err(error).context(
                        "connecting to the cluster (`imgrun stop` clears the records of a \
                         cluster that is gone; --embedded runs on a cluster of its own)",
                    );
                }
            }
        }
        let dir = tempfile::Builder::new()
            .prefix("imgrun-embedded-")
            .tempdir()
            .context("making the embedded cluster's state folder")?;
        let state = runtime::StateDir::at(dir.path());
        let head = runtime::Head::start(runtime::HeadConfig {
            membership: crate::commands::cluster::membership(&config.cluster),
            actors: crate::commands::cluster::actor_hosting(),
            ..runtime::HeadConfig::loopback(
                state.clone(),
                runtime::discover(&runtime::DiscoverOptions::default()),
            )
        })
        .await
        .context("starting the embedded cluster")?;
        let client = ClusterClient::connect(&state, Some(&head.join_address()))
            .await
            .context("connecting to the embedded cluster")?;
        println!(
            "cluster: embedded, on this machine only (no running cluster was found; \
             `imgrun start --head` starts one)"
        );
        Ok(Self {
            client,
            embedded: Some((head, dir)),
            launched: None,
        })
    }

    pub(super) async fn shutdown(self) {
        if let Some(launched) = &self.launched {
            runtime::launch::finish(&self.client, launched.rendezvous.as_deref()).await;
        }
        if let Some((head, _dir)) = self.embedded {
            head.stop().await;
        }
    }
}
