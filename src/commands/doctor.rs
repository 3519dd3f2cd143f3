//! `imgrun doctor`: what this machine and build offer, and whether libtorch works.

use std::process::ExitCode;

use crate::config::Loaded;
use crate::units::human_bytes;

pub fn run(loaded: &Loaded) -> anyhow::Result<ExitCode> {
    let node = runtime::discover(&runtime::DiscoverOptions::default());
    let torch = actors::probe_libtorch();
    println!("imgrun {}", env!("CARGO_PKG_VERSION"));
    println!(
        "host:             {}",
        node.hostname.as_deref().unwrap_or("unknown")
    );
    println!("cores:            {}", node.cpus);
    println!(
        "memory:           {}",
        node.memory_bytes.map_or("unknown".to_string(), human_bytes)
    );
    println!("gpus:             {}", node.gpus.len());
    for gpu in &node.gpus {
        let label = format!("  gpu {}:", gpu.index);
        println!(
            "{label:<18}{}, {}, {} (from {})",
            gpu.name,
            gpu.memory_bytes
                .map_or("memory unknown".to_string(), human_bytes),
            gpu.uuid,
            gpu.source
        );
    }
    println!(
        "libtorch:         {} ({})",
        torch.version.as_deref().unwrap_or("unknown version"),
        torch
            .library_dir
            .as_ref()
            .map_or("location unknown".to_string(), |d| d.display().to_string())
    );
    println!("torch threads:    {}", torch.threads);
    println!(
        "cuda:             {}",
        if torch.cuda_available {
            format!(
                "available, {} device(s), cudnn {}",
                torch.cuda_devices,
                yes_no(torch.cudnn_available)
            )
        } else {
            "not available".to_string()
        }
    );
    println!(
        "nccl:             {}",
        match &torch.nccl {
            Ok(loaded) => loaded.clone(),
            Err(why) => format!("not loaded: {why}"),
        }
    );
    println!(
        "config:           {}",
        loaded
            .file
            .as_ref()
            .map_or("built-in defaults".to_string(), |p| p.display().to_string())
    );
    match &torch.smoke_test {
        Ok(()) => {
            println!("tensor smoke test: ok");
            Ok(ExitCode::SUCCESS)
        }
        Err(problem) => {
            println!("tensor smoke test: FAILED: {problem}");
            Ok(ExitCode::FAILURE)
        }
    }
}

fn yes_no(value: bool) -> &'static str {
    if value { "yes" } else { "no" }
}
