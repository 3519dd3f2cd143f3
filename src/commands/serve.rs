//! `imgrun serve DIR`: arguments, then the server in `crate::serve`.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use crate::config::Loaded;
use crate::serve::{ServeOptions, serve};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Folder of shards to serve.
    dir: PathBuf,
    /// Port to listen on (0 picks a free one) [default: serve.port, 8080].
    #[arg(long)]
    port: Option<u16>,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    bind: IpAddr,
    /// Most requests handled at once [default: serve.max_in_flight, 64].
    #[arg(long)]
    max_in_flight: Option<usize>,
}

pub fn run(loaded: &Loaded, args: ServeArgs) -> anyhow::Result<ExitCode> {
    let options = ServeOptions {
        dir: args.dir,
        bind: SocketAddr::new(args.bind, args.port.unwrap_or(loaded.config.serve.port)),
        max_in_flight: args
            .max_in_flight
            .unwrap_or(loaded.config.serve.max_in_flight),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let dir = options.dir.display().to_string();
    runtime.block_on(serve(
        options,
        move |addr| {
            // Tests and scripts read this line to learn the port.
            println!("serving {dir} on http://{addr}/");
        },
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
    ))?;
    Ok(ExitCode::SUCCESS)
}
