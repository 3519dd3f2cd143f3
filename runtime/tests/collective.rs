//! Ring collectives against direct computation: in-memory rings of 1 to 8 ranks, TCP
//! rings on loopback, refused handshakes and ranks that disagree.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use runtime::{CollectiveError, CollectiveOptions, LinkPath, RingGroup, RingSecret, Transport};
use tokio::net::TcpListener;

/// Bound on every test's ring, so a hang fails instead of stalling the suite.
const TEST_TIMEOUT: Duration = Duration::from_secs(20);

fn options(chunk_bytes: usize) -> CollectiveOptions {
    CollectiveOptions {
        chunk_bytes,
        // The chunked ring on whole buffers; `inline_options` turns the inline path on,
        // `block_options` cuts buffers into blocks.
        inline_bytes: 0,
        block_bytes: 0,
        op_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        local_sockets: true,
    }
}

/// `options(chunk_bytes)` with small buffers sent inline with the header round (up to
/// `inline_bytes` times the world size less one), so both allreduce paths run.
fn inline_options(chunk_bytes: usize, inline_bytes: usize) -> CollectiveOptions {
    CollectiveOptions {
        inline_bytes,
        ..options(chunk_bytes)
    }
}

/// `options(chunk_bytes)` with ring allreduces run block by block.
fn block_options(chunk_bytes: usize, block_bytes: usize) -> CollectiveOptions {
    CollectiveOptions {
        block_bytes,
        ..options(chunk_bytes)
    }
}

/// Runs `body` on every rank of `groups` as its own task and returns the outputs by rank.
async fn run_ranks<T, F, Fut>(groups: Vec<RingGroup>, body: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(RingGroup) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let tasks: Vec<_> = groups.into_iter().map(|g| tokio::spawn(body(g))).collect();
    let mut outputs = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        let output = tokio::time::timeout(TEST_TIMEOUT, task)
            .await
            .with_context(|| format!("rank {rank} hung"))?
            .with_context(|| format!("rank {rank} panicked"))?;
        outputs.push(output);
    }
    Ok(outputs)
}

/// Integer-valued inputs, so every summation order gives the exact same sums.
fn inputs(seed: u64, world: usize, len: usize) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..world)
        .map(|_| {
            (0..len)
                .map(|_| rng.random_range(-1000..1000) as f32)
                .collect()
        })
        .collect()
}

fn direct_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let mut sum = vec![0.0; inputs[0].len()];
    for input in inputs {
        sum.iter_mut().zip(input).for_each(|(s, x)| *s += x);
    }
    sum
}

/// Allreduces every size in `sizes`, in order on one group per rank, and checks each
/// rank's result against the direct sum.
async fn check_allreduce(groups: Vec<RingGroup>, sizes: &[usize], seed: u64) -> Result<()> {
    let world = groups.len();
    let cases: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| inputs(seed + i as u64, world, len))
        .collect();
    let per_rank = std::sync::Arc::new(cases.clone());
    let outputs = run_ranks(groups, |mut group| {
        let cases = per_rank.clone();
        async move {
            let mut results = Vec::new();
            for case in cases.iter() {
                let mut buffer = case[group.rank()].clone();
                group.allreduce_sum(&mut buffer).await?;
                results.push(buffer);
            }
            group.barrier().await?;
            Ok::<_, CollectiveError>(results)
        }
    })
    .await?;
    for (rank, output) in outputs.into_iter().enumerate() {
        let output = output.with_context(|| format!("world {world} rank {rank}"))?;
        for ((case, result), len) in cases.iter().zip(output).zip(sizes) {
            anyhow::ensure!(
                result == direct_sum(case),
                "world {world} rank {rank} len {len}: wrong sum"
            );
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_matches_direct_sum_for_every_world() -> Result<()> {
    // 16-element chunks, so chunk boundaries fall inside small buffers.
    let chunk = 16;
    // The chunked ring, then every size inline with the header round.
    for inline_bytes in [0, usize::MAX] {
        for world in 1..=8usize {
            let mut sizes = vec![0, 1, world.saturating_sub(1), world + 1, 7, 13, 31, 257];
            for boundary in [chunk, world * chunk, 3 * world * chunk] {
                sizes.extend([boundary - 1, boundary, boundary + 1]);
            }
            let groups = RingGroup::in_memory(world, inline_options(chunk * 4, inline_bytes));
            check_allreduce(groups, &sizes, 1000 * world as u64).await?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_of_megabytes_with_default_chunks() -> Result<()> {
    let chunk = runtime::DEFAULT_CHUNK_BYTES / 4;
    let sizes = [chunk - 1, 3 * chunk + 1, 1 << 20];
    check_allreduce(
        RingGroup::in_memory(3, CollectiveOptions::default()),
        &sizes,
        7,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_mean_ignores_ranks_of_weight_zero() -> Result<()> {
    let weights = [1.0f32, 2.0, 0.0, 3.0];
    let values = [[1.0f32, 10.0], [4.0, -2.0], [1e6, f32::MAX], [2.0, 0.5]];
    let outputs = run_ranks(
        RingGroup::in_memory(4, options(4)),
        |mut group| async move {
            let rank = group.rank();
            let mut buffer = values[rank].to_vec();
            let total = group
                .allreduce_mean_weighted(&mut buffer, weights[rank])
                .await?;
            // Every rank out of data: zeros, not NaN.
            let mut idle = vec![5.0f32; 3];
            let idle_total = group.allreduce_mean_weighted(&mut idle, 0.0).await?;
            Ok::<_, CollectiveError>((buffer, total, idle, idle_total))
        },
    )
    .await?;
    let expected = [(1.0 + 8.0 + 6.0) / 6.0, (10.0 - 4.0 + 1.5) / 6.0];
    for (rank, output) in outputs.into_iter().enumerate() {
        let (buffer, total, idle, idle_total) = output?;
        assert_eq!(total, 6.0, "rank {rank}");
        for (got, want) in buffer.iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "rank {rank}: {got} != {want}");
        }
        assert_eq!((idle, idle_total), (vec![0.0; 3], 0.0), "rank {rank}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_copies_the_roots_buffer() -> Result<()> {
    let world = 5;
    let outputs = run_ranks(
        RingGroup::in_memory(world, options(64)),
        |mut group| async move {
            let mut results = Vec::new();
            for root in 0..world {
                for len in [0, 1, 16, 1001] {
                    let mut buffer = inputs(root as u64, world, len)[group.rank()].clone();
                    group.broadcast(&mut buffer, root).await?;
                    results.push((root, len, buffer));
                }
            }
            Ok::<_, CollectiveError>(results)
        },
    )
    .await?;
    for (rank, output) in outputs.into_iter().enumerate() {
        for (root, len, buffer) in output? {
            assert_eq!(
                buffer,
                inputs(root as u64, world, len)[root],
                "rank {rank} root {root}"
            );
        }
    }
    Ok(())
}

/// Ranks that disagree on what to run next: every rank fails, none hangs, and the
/// group is unusable afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disagreeing_ranks_all_fail() -> Result<()> {
    type Case = fn(usize) -> (usize, bool);
    // (length, broadcast instead of allreduce) per rank, and the largest inline buffer:
    // both through the ring, both inline, and rank 2 inline while the others use the ring
    // (which reads and forwards its longer message, so no rank waits for bytes).
    let cases: [(&str, Case, usize); 5] = [
        ("length", |rank| (if rank == 2 { 11 } else { 10 }, false), 0),
        ("operation", |rank| (10, rank == 0), 0),
        (
            "inline length",
            |rank| (if rank == 2 { 11 } else { 10 }, false),
            1024,
        ),
        ("inline operation", |rank| (10, rank == 0), 1024),
        (
            "path",
            |rank| (if rank == 2 { 10 } else { 1000 }, false),
            1024,
        ),
    ];
    for (name, case, inline_bytes) in cases {
        let outputs = run_ranks(
            RingGroup::in_memory(4, inline_options(64, inline_bytes)),
            |mut group| async move {
                let (len, broadcast) = case(group.rank());
                let mut buffer = vec![1.0; len];
                let first = if broadcast {
                    group.broadcast(&mut buffer, 0).await
                } else {
                    group.allreduce_sum(&mut buffer).await
                };
                let after = group.barrier().await;
                (first, after)
            },
        )
        .await?;
        assert_mismatch_then_poisoned(name, outputs);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_rank_fails_its_neighbours() -> Result<()> {
    let mut groups = RingGroup::in_memory(3, options(64));
    drop(groups.remove(1));
    let outputs = run_ranks(groups, |mut group| async move {
        group.allreduce_sum(&mut [1.0; 100]).await
    })
    .await?;
    for output in outputs {
        assert!(
            matches!(output, Err(CollectiveError::PeerClosed { .. })),
            "{output:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_rank_times_its_peers_out() -> Result<()> {
    let quick = CollectiveOptions {
        op_timeout: Duration::from_millis(200),
        ..options(64)
    };
    let mut groups = RingGroup::in_memory(3, quick);
    // Rank 2 stays in the ring but never joins the operation.
    let silent = groups.pop();
    // Each rank hands its group back, so no link closes before every rank timed out.
    let outputs = run_ranks(groups, |mut group| async move {
        (group.allreduce_sum(&mut [1.0; 100]).await, group)
    })
    .await?;
    drop(silent);
    for (output, _group) in outputs {
        assert!(
            matches!(
                output,
                Err(CollectiveError::Timeout {
                    what: "allreduce",
                    ..
                })
            ),
            "{output:?}"
        );
    }
    Ok(())
}

/// Binds one loopback listener per rank and connects the ring, one task per rank;
/// `secrets[rank]` and `ring_ids[rank]` let a test misconfigure a rank.
async fn tcp_ring(
    secrets: Vec<RingSecret>,
    ring_ids: Vec<&'static str>,
    options: CollectiveOptions,
) -> Result<Vec<(SocketAddr, std::result::Result<RingGroup, CollectiveError>)>> {
    let per_rank = vec![options; secrets.len()];
    tcp_ring_with(secrets, ring_ids, per_rank).await
}

/// The groups of a [`tcp_ring`] that every rank formed (the first rank's error if not).
fn formed(
    ring: Vec<(SocketAddr, std::result::Result<RingGroup, CollectiveError>)>,
) -> Result<Vec<RingGroup>> {
    Ok(ring
        .into_iter()
        .map(|(_, group)| group)
        .collect::<std::result::Result<Vec<_>, _>>()?)
}

/// The formed groups of the ring `ring_id` with one secret and each rank's own options.
async fn formed_with(
    ring_id: &'static str,
    per_rank: Vec<CollectiveOptions>,
) -> Result<Vec<RingGroup>> {
    let world = per_rank.len();
    formed(
        tcp_ring_with(
            vec![RingSecret::random(); world],
            vec![ring_id; world],
            per_rank,
        )
        .await?,
    )
}

/// [`tcp_ring`] with each rank's own options.
async fn tcp_ring_with(
    secrets: Vec<RingSecret>,
    ring_ids: Vec<&'static str>,
    options: Vec<CollectiveOptions>,
) -> Result<Vec<(SocketAddr, std::result::Result<RingGroup, CollectiveError>)>> {
    let world = secrets.len();
    let mut listeners = Vec::new();
    for _ in 0..world {
        listeners.push(TcpListener::bind("127.0.0.1:0").await?);
    }
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<std::io::Result<_>>()?;
    let tasks: Vec<_> = listeners
        .into_iter()
        .zip(secrets)
        .zip(ring_ids)
        .zip(options)
        .enumerate()
        .map(|(rank, (((listener, secret), ring_id), options))| {
            let next = addrs[(rank + 1) % world];
            tokio::spawn(async move {
                RingGroup::connect(rank, world, listener, next, &secret, ring_id, options).await
            })
        })
        .collect();
    let mut groups = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        let group = tokio::time::timeout(TEST_TIMEOUT, task)
            .await
            .with_context(|| format!("rank {rank} hung connecting"))??;
        groups.push((addrs[rank], group));
    }
    Ok(groups)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_ring_allreduces_megabytes() -> Result<()> {
    // On one host, neighbours link over Unix sockets unless told not to.
    for (local_sockets, transport) in [(false, Transport::Tcp), (true, Transport::Unix)] {
        for world in [2, 4] {
            let secret = RingSecret::random();
            let options = CollectiveOptions {
                local_sockets,
                ..CollectiveOptions::default()
            };
            let ring = tcp_ring(vec![secret; world], vec!["ring-1"; world], options).await?;
            let groups = formed(ring)?;
            for group in &groups {
                assert_eq!(transports(group), (transport, transport), "world {world}");
            }
            // 1 Mi floats (4 MiB) and a size that is not a multiple of anything.
            check_allreduce(groups, &[1 << 20, 1_000_003, 0, 5], 42).await?;
        }
    }
    Ok(())
}

/// How `group`'s link sends to its next rank and receives from its previous one.
fn transports(group: &RingGroup) -> (Transport, Transport) {
    let link = group.link().expect("a ring of two or more has a link");
    (link.next_transport(), link.prev_transport())
}

/// A rank that does not listen on a Unix socket (so its previous rank finds none) still
/// joins the ring: the links to and from it fall back to TCP, the others stay on Unix
/// sockets, and the sums are the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_ring_falls_back_to_tcp_without_a_unix_socket() -> Result<()> {
    let world = 3;
    let per_rank = (0..world)
        .map(|rank| CollectiveOptions {
            local_sockets: rank != 1,
            ..CollectiveOptions::default()
        })
        .collect();
    let groups = formed_with("ring", per_rank).await?;
    let expected = [
        (Transport::Tcp, Transport::Unix),
        (Transport::Tcp, Transport::Tcp),
        (Transport::Unix, Transport::Tcp),
    ];
    for (rank, group) in groups.iter().enumerate() {
        assert_eq!(transports(group), expected[rank], "rank {rank}");
    }
    check_allreduce(groups, &[1 << 20, 1_000_003, 5], 7).await
}

/// Ranks whose options put the same allreduce on different paths (inline or ring) or cut
/// it into different blocks: every rank fails with a mismatch, none hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_with_different_paths_or_blocks_all_fail() -> Result<()> {
    let world = 3;
    // (case, rank 1's options, the others', length)
    let cases = [
        ("path", inline_options(64, 0), inline_options(64, 1024), 10),
        ("block", block_options(64, 64), block_options(64, 128), 1000),
    ];
    for (name, odd, usual, len) in cases {
        let per_rank = (0..world)
            .map(|rank| {
                if rank == 1 {
                    odd.clone()
                } else {
                    usual.clone()
                }
            })
            .collect();
        let groups = formed_with("odd", per_rank).await?;
        let outputs = run_ranks(groups, move |mut group| async move {
            let first = group.allreduce_sum(&mut vec![1.0; len]).await;
            let after = group.barrier().await;
            (first, after)
        })
        .await?;
        assert_mismatch_then_poisoned(name, outputs);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_ring_refuses_wrong_secret_and_ring_id() -> Result<()> {
    let secret = RingSecret::random();
    let quick = CollectiveOptions {
        connect_timeout: Duration::from_millis(1500),
        ..options(64)
    };
    // Rank 0 is misconfigured; it connects to rank 1, which must refuse it.
    let cases = [
        (
            "secret",
            vec![RingSecret::random(), secret.clone()],
            vec!["ring"; 2],
        ),
        (
            "ring id",
            vec![secret.clone(), secret.clone()],
            vec!["other", "ring"],
        ),
    ];
    // Over TCP only, then with Unix sockets first.
    for local_sockets in [false, true] {
        for (name, secrets, ring_ids) in cases.clone() {
            let options = CollectiveOptions {
                local_sockets,
                ..quick.clone()
            };
            let ring = tcp_ring(secrets, ring_ids, options).await?;
            let name = format!("{name}, local sockets {local_sockets}");
            let rank1_addr = ring[1].0;
            let refused_at = match &ring[0].1 {
                Err(CollectiveError::Handshake {
                    rank: 0,
                    peer: 1,
                    path,
                    ..
                }) => match path.as_ref() {
                    LinkPath::Tcp(addr) => *addr,
                    // Refused over rank 1's Unix socket (then rank 1 may be gone before
                    // the TCP retry): the error still names rank 1 and its address.
                    LinkPath::Unix { beside, .. } if local_sockets => *beside,
                    other => panic!("{name}: rank 0 refused over {other}"),
                },
                Err(CollectiveError::Connect {
                    rank: 0,
                    peer: 1,
                    addr,
                    ..
                }) if local_sockets => *addr,
                other => panic!("{name}: rank 0 got {other:?}"),
            };
            assert_eq!(refused_at, rank1_addr, "{name}");
            match &ring[1].1 {
                Err(CollectiveError::Handshake {
                    rank: 1, peer: 0, ..
                }) => {}
                // Rank 0, refused over a Unix socket, may be gone before rank 1 connects
                // to it (as rank 1 may be before rank 0's TCP retry, above).
                Err(CollectiveError::Connect {
                    rank: 1, peer: 0, ..
                }) if local_sockets => {}
                other => panic!("{name}: rank 1 got {other:?}"),
            }
            let message = ring[0].1.as_ref().err().map(ToString::to_string);
            assert!(
                message
                    .as_deref()
                    .is_some_and(|m| m.contains(&rank1_addr.to_string())),
                "{name}: {message:?}"
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Property tests: random real-valued inputs against sums computed directly in f64.
//
// Every case derives its inputs from `BASE_SEED` (or `COLLECTIVE_SEED=<u64>` in the
// environment, to explore other seeds) and names its seed in any failure message, so a
// failing case reruns with `COLLECTIVE_SEED=<seed> cargo test -p runtime --test collective`.
// ---------------------------------------------------------------------------------------

const BASE_SEED: u64 = 0x1a2b_3c4d;

fn base_seed() -> u64 {
    std::env::var("COLLECTIVE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(BASE_SEED)
}

/// One operation of a schedule that every rank runs in order on the same group, as DDP
/// runs its gradient buckets.
#[derive(Clone, Debug)]
enum Bucket {
    /// `inputs[rank]` is allreduced with `allreduce_sum`.
    Sum { inputs: Vec<Vec<f32>> },
    /// `inputs[rank]` is averaged with `allreduce_mean_weighted(.., weights[rank])`.
    Mean {
        inputs: Vec<Vec<f32>>,
        weights: Vec<f32>,
    },
}

impl Bucket {
    fn len(&self) -> usize {
        match self {
            Bucket::Sum { inputs } | Bucket::Mean { inputs, .. } => inputs[0].len(),
        }
    }

    /// The exact result (in f64) and how far an f32 ring may stray from it, per element,
    /// plus the total weight for a mean.
    fn expected(&self) -> (Vec<f64>, Vec<f64>, Option<f64>) {
        let world = match self {
            Bucket::Sum { inputs } | Bucket::Mean { inputs, .. } => inputs.len(),
        };
        // Summing n f32 terms in any order errs by at most (n - 1) u * sum |x|, with u
        // the unit roundoff (EPSILON / 2); the result's own rounding adds u * |sum|.
        let eps = f64::from(f32::EPSILON);
        match self {
            Bucket::Sum { inputs } => {
                let (sums, bounds) = (0..self.len())
                    .map(|i| {
                        let sum: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
                        let abs: f64 = inputs.iter().map(|x| f64::from(x[i]).abs()).sum();
                        (sum, world as f64 * eps * abs + f64::from(f32::MIN_POSITIVE))
                    })
                    .unzip();
                (sums, bounds, None)
            }
            Bucket::Mean { inputs, weights } => {
                let total: f64 = weights.iter().copied().map(f64::from).sum();
                let (means, bounds) = (0..self.len())
                    .map(|i| {
                        if total == 0.0 {
                            return (0.0, 0.0);
                        }
                        // A rank of weight 0 contributes nothing, whatever its buffer holds.
                        let terms = || {
                            inputs
                                .iter()
                                .zip(weights)
                                .filter(|(_, w)| **w > 0.0)
                                .map(|(x, w)| f64::from(x[i]) * f64::from(*w))
                        };
                        let sum: f64 = terms().sum();
                        let abs: f64 = terms().map(f64::abs).sum();
                        // Products, the sum of products, the sum of weights and the
                        // division each add their rounding.
                        (sum / total, (world as f64 + 3.0) * eps * abs / total)
                    })
                    .unzip();
                (means, bounds, Some(total))
            }
        }
    }
}

/// Random values of mixed sign spread over six orders of magnitude.
fn random_values(rng: &mut StdRng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| {
            let exponent = rng.random_range(-3..=3);
            rng.random_range(-1.0f32..1.0) * 10f32.powi(exponent)
        })
        .collect()
}

fn sum_bucket(rng: &mut StdRng, world: usize, len: usize) -> Bucket {
    Bucket::Sum {
        inputs: (0..world).map(|_| random_values(rng, len)).collect(),
    }
}

/// A weighted mean where about a third of the ranks (or, with `all_idle`, every rank)
/// has weight 0; ranks of weight 0 hold garbage, NaN and infinities included.
fn mean_bucket(rng: &mut StdRng, world: usize, len: usize, all_idle: bool) -> Bucket {
    let weights: Vec<f32> = (0..world)
        .map(|_| {
            if all_idle || rng.random_range(0..3) == 0 {
                0.0
            } else if rng.random() {
                rng.random_range(1..64) as f32
            } else {
                rng.random_range(0.01f32..10.0)
            }
        })
        .collect();
    let inputs = weights
        .iter()
        .map(|&w| {
            let mut values = random_values(rng, len);
            if w == 0.0 {
                for (i, x) in values.iter_mut().enumerate() {
                    *x = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX][i % 4];
                }
            }
            values
        })
        .collect();
    Bucket::Mean { inputs, weights }
}

/// Runs `schedule` on every rank of `groups` in order and checks every rank's results
/// against [`Bucket::expected`]; all ranks must also agree bit for bit, as DDP's replicas
/// must stay identical. `case` names the case (seed included) in failures.
async fn check_schedule(case: &str, groups: Vec<RingGroup>, schedule: Vec<Bucket>) -> Result<()> {
    let world = groups.len();
    let schedule = std::sync::Arc::new(schedule);
    let outputs = run_ranks(groups, |mut group| {
        let schedule = schedule.clone();
        async move {
            let rank = group.rank();
            let mut results = Vec::new();
            for bucket in schedule.iter() {
                match bucket {
                    Bucket::Sum { inputs } => {
                        let mut buffer = inputs[rank].clone();
                        group.allreduce_sum(&mut buffer).await?;
                        results.push((buffer, None));
                    }
                    Bucket::Mean { inputs, weights } => {
                        let mut buffer = inputs[rank].clone();
                        let total = group
                            .allreduce_mean_weighted(&mut buffer, weights[rank])
                            .await?;
                        results.push((buffer, Some(total)));
                    }
                }
            }
            Ok::<_, CollectiveError>(results)
        }
    })
    .await
    .with_context(|| format!("{case}: world {world}"))?;
    let outputs = outputs
        .into_iter()
        .enumerate()
        .map(|(rank, output)| output.with_context(|| format!("{case}: world {world} rank {rank}")))
        .collect::<Result<Vec<_>>>()?;
    for (b, bucket) in schedule.iter().enumerate() {
        let what = format!(
            "{case}: world {world} bucket {b} ({} elements)",
            bucket.len()
        );
        let (want, bounds, want_total) = bucket.expected();
        let (first, first_total) = &outputs[0][b];
        for (rank, output) in outputs.iter().enumerate() {
            let (got, total) = &output[b];
            anyhow::ensure!(
                got.len() == want.len(),
                "{what} rank {rank}: length changed"
            );
            anyhow::ensure!(
                got.iter()
                    .map(|x| x.to_bits())
                    .eq(first.iter().map(|x| x.to_bits()))
                    && total == first_total,
                "{what}: rank {rank} disagrees with rank 0"
            );
            if let (Some(got), Some(want)) = (total, want_total) {
                let bound = world as f64 * f64::from(f32::EPSILON) * want;
                anyhow::ensure!(
                    (f64::from(*got) - want).abs() <= bound,
                    "{what} rank {rank}: total weight {got} != {want}"
                );
            }
        }
        for (i, ((&got, want), bound)) in first.iter().zip(&want).zip(&bounds).enumerate() {
            anyhow::ensure!(
                (f64::from(got) - want).abs() <= *bound,
                "{what} element {i}: got {got}, want {want} (tolerance {bound:e})"
            );
        }
    }
    Ok(())
}

/// Sizes that stress the ring's arithmetic for `world` ranks and chunks of `chunk`
/// floats: empty, tiny, odd, fewer elements than ranks, and both sides of every segment
/// and chunk boundary, plus a few random ones.
fn interesting_sizes(rng: &mut StdRng, world: usize, chunk: usize) -> Vec<usize> {
    let mut sizes = vec![
        0,
        1,
        2,
        3,
        5,
        7,
        31,
        97,
        world - 1,
        world,
        world + 1,
        2 * world + 1,
    ];
    for boundary in [
        chunk,
        world * chunk,
        2 * world * chunk,
        5 * world * chunk + chunk,
    ] {
        sizes.extend([boundary.saturating_sub(1), boundary, boundary + 1]);
    }
    sizes.extend((0..4).map(|_| rng.random_range(0..8 * world * chunk)));
    sizes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_allreduce_matches_f64_sum_for_every_world_and_chunk() -> Result<()> {
    // Chunks of 1, 2 (10 bytes round down to whole floats) and 16 floats hit many chunk
    // boundaries with small buffers.
    // Inline 0: the chunked ring for every size; 1 KiB: small sizes inline, the rest
    // through the ring, on one group.
    for (chunk_bytes, inline_bytes) in [(4, 0), (10, 0), (64, 0), (64, 1024)] {
        let chunk = (chunk_bytes / 4).max(1);
        for world in 1..=8usize {
            let seed = base_seed() ^ ((world as u64) << 32) ^ chunk_bytes as u64;
            let mut rng = StdRng::seed_from_u64(seed);
            let schedule = interesting_sizes(&mut rng, world, chunk)
                .into_iter()
                .map(|len| sum_bucket(&mut rng, world, len))
                .collect();
            let case = format!("seed {seed} chunk_bytes {chunk_bytes} inline_bytes {inline_bytes}");
            check_schedule(
                &case,
                RingGroup::in_memory(world, inline_options(chunk_bytes, inline_bytes)),
                schedule,
            )
            .await?;
        }
    }
    Ok(())
}

/// Ring allreduces cut into blocks: blocks of 1, 3, 7 and 100 values (fewer than the
/// ranks, odd, larger than a chunk), buffers on both sides of block edges and shorter
/// than the world, sums and weighted means, worlds of 2 to 5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_allreduce_matches_f64_sum_for_worlds_2_to_5() -> Result<()> {
    for block_bytes in [4, 12, 28, 400] {
        let block = block_bytes / 4;
        for world in 2..=5usize {
            let seed = base_seed() ^ ((world as u64) << 40) ^ block_bytes as u64;
            let mut rng = StdRng::seed_from_u64(seed);
            let mut sizes = vec![0, 1, world - 1, world, world + 1, 2 * world + 1];
            for edge in [block, 3 * block, world * block] {
                sizes.extend([edge.saturating_sub(1), edge, edge + 1]);
            }
            sizes.push(rng.random_range(0..20 * block + 50));
            let schedule = sizes
                .into_iter()
                .enumerate()
                .map(|(i, len)| match i % 3 {
                    2 => mean_bucket(&mut rng, world, len, false),
                    _ => sum_bucket(&mut rng, world, len),
                })
                .collect();
            let case = format!("seed {seed} block_bytes {block_bytes}");
            // Chunks of 2 values, so a block of 3 or more spans several.
            let groups = RingGroup::in_memory(world, block_options(8, block_bytes));
            check_schedule(&case, groups, schedule).await?;
        }
    }
    Ok(())
}

/// DDP-like: buckets of varying sizes, sums and weighted means mixed, back to back on one
/// group, with weight-0 ranks and steps where every rank is out of data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_buckets_in_a_row_on_one_group() -> Result<()> {
    for world in 1..=8usize {
        let seed = base_seed().wrapping_add(world as u64);
        let mut rng = StdRng::seed_from_u64(seed);
        let schedule = (0..16)
            .map(|i| {
                let len = match i % 4 {
                    0 => rng.random_range(0..50),
                    1 => rng.random_range(50..5_000),
                    _ => rng.random_range(5_000..20_000),
                };
                match i % 3 {
                    0 => sum_bucket(&mut rng, world, len),
                    1 => mean_bucket(&mut rng, world, len, false),
                    _ => mean_bucket(&mut rng, world, len, i % 5 == 0),
                }
            })
            .collect();
        let case = format!("seed {seed}");
        // Chunks of 4 KiB, so the larger buckets span many of them; the smaller ones go
        // inline with the header round, so the paths alternate on one group.
        let options = inline_options(4096, runtime::DEFAULT_INLINE_BYTES);
        check_schedule(&case, RingGroup::in_memory(world, options), schedule).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_allreduce_of_several_megabytes() -> Result<()> {
    for (world, len) in [(2, (1 << 20) + 3), (5, (1 << 19) + 7)] {
        let seed = base_seed().wrapping_mul(31).wrapping_add(world as u64);
        let mut rng = StdRng::seed_from_u64(seed);
        let schedule = vec![
            sum_bucket(&mut rng, world, len),
            mean_bucket(&mut rng, world, len / 4, false),
        ];
        let case = format!("seed {seed}");
        let groups = RingGroup::in_memory(world, CollectiveOptions::default());
        check_schedule(&case, groups, schedule).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_buckets_over_tcp() -> Result<()> {
    let default_chunk = runtime::DEFAULT_CHUNK_BYTES / 4;
    let cases = [
        (2, 64, vec![0, 1, 31, 33, 16 * 20 + 1, 300_001]),
        (3, 4096, vec![3 * 1024 - 1, 0, 3 * 1024 + 1, 5, 40_000]),
        (
            4,
            runtime::DEFAULT_CHUNK_BYTES,
            vec![1, default_chunk + 1, 0, 300_001],
        ),
    ];
    for (world, chunk_bytes, sizes) in cases {
        let seed = base_seed().wrapping_sub(world as u64);
        let mut rng = StdRng::seed_from_u64(seed);
        let schedule = sizes
            .into_iter()
            .enumerate()
            .map(|(i, len)| match i % 2 {
                0 => sum_bucket(&mut rng, world, len),
                _ => mean_bucket(&mut rng, world, len, false),
            })
            .collect();
        let ring = tcp_ring(
            vec![RingSecret::random(); world],
            vec!["props"; world],
            CollectiveOptions {
                block_bytes: runtime::DEFAULT_BLOCK_BYTES,
                ..inline_options(chunk_bytes, runtime::DEFAULT_INLINE_BYTES)
            },
        )
        .await?;
        let groups = formed(ring)?;
        let case = format!("seed {seed} tcp chunk_bytes {chunk_bytes}");
        check_schedule(&case, groups, schedule).await?;
    }
    Ok(())
}

type Outcome = std::result::Result<(), CollectiveError>;

/// Every rank's first operation failed with `Mismatch` naming itself, and the next with
/// `Poisoned`.
fn assert_mismatch_then_poisoned(name: &str, outputs: Vec<(Outcome, Outcome)>) {
    for (rank, (first, after)) in outputs.into_iter().enumerate() {
        assert!(
            matches!(first, Err(CollectiveError::Mismatch { rank: r, .. }) if r == rank),
            "{name}: rank {rank}: {first:?}"
        );
        assert!(
            matches!(after, Err(CollectiveError::Poisoned { .. })),
            "{name}: rank {rank}: {after:?}"
        );
    }
}
