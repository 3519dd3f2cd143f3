//! `imgrun serve DIR`: arguments, then the server in `crate::serve`.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;

use crate::config::Loaded;
use crate::serve::{ServeOptions, Timeouts, serve};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Folder of shards to serve.
    dir: PathBuf,
    /// Port to listen on (0 picks a free one) [default: serve.port, 8080].
    #[arg(long)]
    port: Option<u16>,
    /// Address to listen on. The default, 0.0.0.0, is every network interface: every
    /// machine that can reach this one can read the folder. Give 127.0.0.1 to serve this
    /// machine only, or one interface's address.
    #[arg(long, default_value = "0.0.0.0")]
    bind: IpAddr,
    /// Most requests handled at once [default: serve.max_in_flight, 64].
    #[arg(long)]
    max_in_flight: Option<usize>,
    /// Most of those one client (peer address) may hold at once; its others wait
    /// [default: serve.max_per_client, 32].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_per_client: Option<u64>,
    /// Seconds a connection may take to send a request before it is closed [default:
    /// serve.header_timeout_secs, 30].
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    header_timeout: Option<u64>,
    /// Seconds a client may take no bytes of a response before it is dropped and its slot
    /// freed [default: serve.send_timeout_secs, 60].
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    send_timeout: Option<u64>,
    /// Follow symbolic links that lead out of the folder (by default such a link is a
    /// 404, and links that stay inside work) [default: serve.follow_links, false].
    #[arg(long)]
    follow_links: bool,
}

pub fn run(loaded: &Loaded, args: ServeArgs) -> anyhow::Result<ExitCode> {
    let config = &loaded.config.serve;
    let secs = |flag: Option<u64>, key: u64| Duration::from_secs(flag.unwrap_or(key));
    let options = ServeOptions {
        dir: args.dir,
        bind: SocketAddr::new(args.bind, args.port.unwrap_or(config.port)),
        max_in_flight: args.max_in_flight.unwrap_or(config.max_in_flight),
        max_per_client: args.max_per_client.map_or(config.max_per_client, |n| {
            usize::try_from(n).unwrap_or(usize::MAX)
        }),
        timeouts: Timeouts {
            header: secs(args.header_timeout, config.header_timeout_secs),
            send: secs(args.send_timeout, config.send_timeout_secs),
        },
        follow_links: args.follow_links || config.follow_links,
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
