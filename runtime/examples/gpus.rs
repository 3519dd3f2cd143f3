//! Prints what GPU discovery finds on this machine under a few `CUDA_VISIBLE_DEVICES`
//! values and `--num-gpus` overrides: `cargo run -p runtime --example gpus`.

use runtime::{DiscoverOptions, NodeResources, VisibleDevices, discover};

fn main() {
    let default = discover(&DiscoverOptions::default());
    show("default (inherited environment)", &default);

    let all = DiscoverOptions {
        visible_devices: VisibleDevices::Unset,
        ..DiscoverOptions::default()
    };
    let all = discover(&all);
    show("CUDA_VISIBLE_DEVICES unset", &all);

    let mut values = vec!["0".to_string()];
    if let Some(first) = all.gpus.first() {
        // `GPU-` and the first eight hex digits, as people type it.
        values.push(first.uuid.chars().take(12).collect());
    }
    values.extend(["5", "", "-1", "1,0"].map(String::from));
    for value in values {
        let options = DiscoverOptions {
            visible_devices: VisibleDevices::Set(value.clone()),
            ..DiscoverOptions::default()
        };
        show(
            &format!("CUDA_VISIBLE_DEVICES={value:?}"),
            &discover(&options),
        );
    }

    for num_gpus in [0, 1, 3] {
        let options = DiscoverOptions {
            num_gpus: Some(num_gpus),
            visible_devices: VisibleDevices::Unset,
            ..DiscoverOptions::default()
        };
        show(&format!("--num-gpus {num_gpus}"), &discover(&options));
    }
}

fn show(label: &str, node: &NodeResources) {
    println!(
        "{label}: host {}, {} cpus, memory {}, {} gpu(s)",
        node.hostname.as_deref().unwrap_or("unknown"),
        node.cpus,
        node.memory_bytes
            .map_or("unknown".to_string(), |b| format!("{b} B")),
        node.gpus.len()
    );
    for gpu in &node.gpus {
        println!(
            "  index {}: {} | memory {} | {} | source {} | discovered {}",
            gpu.index,
            gpu.name,
            gpu.memory_bytes
                .map_or("unknown".to_string(), |b| format!("{b} B")),
            gpu.uuid,
            gpu.source,
            gpu.discovered()
        );
    }
}
