//! Decentralized mixing against direct computation: every topology on worlds of 1 to 8
//! ranks in memory, TCP groups on loopback, and a lost member.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use runtime::{CollectiveOptions, MixError, Mixer, RingSecret, Topology};
use tokio::net::TcpListener;

/// Bound on every test's mixing, so a hang fails instead of stalling the suite.
const TEST_TIMEOUT: Duration = Duration::from_secs(30);

fn options() -> CollectiveOptions {
    CollectiveOptions {
        chunk_bytes: 64,
        op_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        ..CollectiveOptions::default()
    }
}

fn layouts(world: usize) -> Vec<Vec<u32>> {
    vec![
        (0..world as u32).collect(),
        (0..world as u32).map(|r| r / 2).collect(),
    ]
}

fn inputs(seed: u64, world: usize, len: usize) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..world)
        .map(|_| (0..len).map(|_| rng.random_range(-100.0..100.0)).collect())
        .collect()
}

/// What `steps` mixing steps should give, in f64.
fn reference(topology: Topology, nodes: &[u32], start: &[Vec<f32>], steps: u64) -> Vec<Vec<f64>> {
    let mut values: Vec<Vec<f64>> = start
        .iter()
        .map(|v| v.iter().map(|&x| f64::from(x)).collect())
        .collect();
    for step in 0..steps {
        for group in topology.groups(nodes, step) {
            let len = values[0].len();
            let mut mean = vec![0.0; len];
            for &rank in &group {
                for (m, v) in mean.iter_mut().zip(&values[rank as usize]) {
                    *m += v / group.len() as f64;
                }
            }
            for &rank in &group {
                values[rank as usize].clone_from(&mean);
            }
        }
    }
    values
}

/// Every rank mixes its buffer for `steps` steps, each on a task of its own; the buffers
/// by rank.
async fn mix_all(mixers: Vec<Mixer>, start: Vec<Vec<f32>>, steps: u64) -> Result<Vec<Vec<f32>>> {
    let tasks: Vec<_> = mixers
        .into_iter()
        .zip(start)
        .map(|(mut mixer, mut buffer)| {
            tokio::spawn(async move {
                for step in 0..steps {
                    mixer.mix(step, &mut buffer).await?;
                }
                Ok::<_, MixError>(buffer)
            })
        })
        .collect();
    let mut out = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        let buffer = tokio::time::timeout(TEST_TIMEOUT, task)
            .await
            .with_context(|| format!("rank {rank} hung"))?
            .with_context(|| format!("rank {rank} panicked"))??;
        out.push(buffer);
    }
    Ok(out)
}

fn check(
    topology: Topology,
    nodes: &[u32],
    start: &[Vec<f32>],
    steps: u64,
    got: &[Vec<f32>],
) -> Result<()> {
    let want = reference(topology, nodes, start, steps);
    for (rank, (got, want)) in got.iter().zip(&want).enumerate() {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            ensure!(
                (f64::from(*g) - w).abs() < 1e-3,
                "{topology} nodes {nodes:?}: rank {rank} value {i}: {g} against {w}"
            );
        }
    }
    // The last step's groups end bit-identical.
    if steps > 0 {
        for group in topology.groups(nodes, steps - 1) {
            let first = &got[group[0] as usize];
            for &rank in &group[1..] {
                ensure!(
                    got[rank as usize] == *first,
                    "{topology}: ranks {} and {rank} of {group:?} differ after mixing",
                    group[0]
                );
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixing_in_memory_matches_the_schedule_for_every_topology_and_world() -> Result<()> {
    for world in 1..=8 {
        for nodes in layouts(world) {
            for topology in Topology::ALL {
                let steps = 2 * topology.period(&nodes) + 1;
                let start = inputs(world as u64, world, 37);
                let mixers = Mixer::in_memory(topology, &nodes, options());
                let got = mix_all(mixers, start.clone(), steps).await?;
                check(topology, &nodes, &start, steps, &got)?;
            }
        }
    }
    Ok(())
}

/// Binds a loopback listener per group of every rank and connects every mixer.
async fn tcp_mixers(
    topology: Topology,
    nodes: &[u32],
    secrets: Vec<RingSecret>,
) -> Result<Vec<std::result::Result<Mixer, MixError>>> {
    let world = nodes.len();
    let mut listeners = Vec::new();
    let mut addresses: HashMap<(Vec<u32>, u32), SocketAddr> = HashMap::new();
    for rank in 0..world as u32 {
        let mut mine = Vec::new();
        for group in Mixer::groups_of(topology, nodes, rank) {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            addresses.insert((group, rank), listener.local_addr()?);
            mine.push(listener);
        }
        listeners.push(mine);
    }
    let tasks: Vec<_> = listeners
        .into_iter()
        .zip(secrets)
        .enumerate()
        .map(|(rank, (listeners, secret))| {
            let nodes = nodes.to_vec();
            let addresses = addresses.clone();
            tokio::spawn(async move {
                Mixer::connect(
                    rank as u32,
                    topology,
                    &nodes,
                    listeners,
                    |group, peer| addresses.get(&(group.to_vec(), peer)).copied(),
                    &secret,
                    "job-mix",
                    options(),
                )
                .await
            })
        })
        .collect();
    let mut mixers = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        let mixer = tokio::time::timeout(TEST_TIMEOUT, task)
            .await
            .with_context(|| format!("rank {rank} hung connecting"))??;
        mixers.push(mixer);
    }
    Ok(mixers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixing_over_tcp_matches_the_schedule() -> Result<()> {
    for (topology, nodes) in [
        (Topology::OnePeerExponential, vec![0, 1, 2, 3, 4]),
        (Topology::Ring, vec![0, 1, 2, 3]),
        (Topology::AlternatingExpRing, vec![0, 0, 1, 1, 2, 2]),
        (Topology::Complete, vec![0, 1, 2]),
    ] {
        let world = nodes.len();
        let secret = RingSecret::random();
        let mixers = tcp_mixers(topology, &nodes, vec![secret; world])
            .await?
            .into_iter()
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let steps = 2 * topology.period(&nodes) + 1;
        let start = inputs(7, world, 100_003);
        let got = mix_all(mixers, start.clone(), steps).await?;
        check(topology, &nodes, &start, steps, &got)?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_the_wrong_secret_is_refused_and_named() -> Result<()> {
    let nodes = [0, 1];
    let secrets = vec![RingSecret::random(), RingSecret::random()];
    let mixers = tcp_mixers(Topology::Ring, &nodes, secrets).await?;
    for (rank, mixer) in mixers.into_iter().enumerate() {
        let error = mixer
            .err()
            .with_context(|| format!("rank {rank} connected"))?;
        let text = error.to_string();
        ensure!(
            matches!(error, MixError::Connect { .. }) && text.contains("[0, 1]"),
            "rank {rank}: {text}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_member_fails_its_group_naming_the_step_and_the_ranks() -> Result<()> {
    let nodes = [0, 1, 2, 3];
    let mut mixers = Mixer::in_memory(Topology::OnePeerExponential, &nodes, options());
    // Rank 1 is gone; rank 0 averages with it at step 0.
    drop(mixers.remove(1));
    let mut rank0 = mixers.remove(0);
    let mut buffer = vec![1.0f32; 1000];
    let error = tokio::time::timeout(TEST_TIMEOUT, rank0.mix(0, &mut buffer))
        .await
        .context("rank 0 hung")?
        .err()
        .context("rank 0 mixed without rank 1")?;
    let text = error.to_string();
    ensure!(
        text.contains("rank 0: mixing at step 0 with ranks [0, 1]"),
        "{text}"
    );
    ensure!(rank0.group(1) == vec![0, 2]);
    Ok(())
}
