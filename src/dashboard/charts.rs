//! A job's charts for its page: its `metrics.jsonl`, fetched from its coordinator a piece
//! at a time and only what is new since the last look, drawn on the server as one SVG
//! (`imgrun plot`'s four panels) again only when the file grew. At most
//! [`MAX_METRICS_BYTES`] of a file are kept; a longer run's chart says to use `imgrun
//! plot`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actors::job::{COORDINATOR_CALL_TIMEOUT, MetricsRequest, call_coordinator, coordinator};
use anyhow::Context as _;
use runtime::ClusterClient;

/// The most of one job's `metrics.jsonl` the dashboard keeps.
const MAX_METRICS_BYTES: usize = 64 << 20;

/// The most asked of a coordinator in one call.
const PIECE_BYTES: u64 = 4 << 20;

/// How often one job's file is looked at again, at the most.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// A chart is drawn again no sooner than this many times the time its last drawing took,
/// so that drawing takes at most a twentieth of a core however large the file.
const DRAW_SHARE: u32 = 20;

/// The most jobs whose files are kept; the one looked at longest ago goes first.
const MAX_JOBS: usize = 16;

/// The size of the SVG, in its own units (it scales to the page).
const SIZE: (u32, u32) = (1200, 750);

/// Each job's file so far and its chart.
pub(super) struct Charts {
    client: ClusterClient,
    draw_chart: super::DrawChart,
    jobs: tokio::sync::Mutex<HashMap<String, JobChart>>,
}

struct JobChart {
    bytes: Vec<u8>,
    /// The chart of `bytes`, once drawn.
    svg: Option<Arc<String>>,
    looked: Instant,
    /// How long the last drawing took.
    drawn_in: Duration,
}

impl Charts {
    pub(super) fn new(client: ClusterClient, draw_chart: super::DrawChart) -> Self {
        Charts {
            client,
            draw_chart,
            jobs: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The chart of job `name`; `None` when the cluster has no such job.
    pub(super) async fn svg(&self, name: &str) -> anyhow::Result<Option<Arc<String>>> {
        let mut jobs = self.jobs.lock().await;
        if let Some(chart) = jobs.get(name)
            && let Some(svg) = &chart.svg
            && chart.looked.elapsed() < LOOK_EVERY.max(chart.drawn_in * DRAW_SHARE)
        {
            return Ok(Some(Arc::clone(svg)));
        }
        let Some(actor) = coordinator(&self.client, name)
            .await
            .context("asking the head")?
        else {
            jobs.remove(name);
            return Ok(None);
        };
        if !jobs.contains_key(name) && jobs.len() >= MAX_JOBS {
            let oldest = jobs
                .iter()
                .min_by_key(|(_, chart)| chart.looked)
                .map(|(job, _)| job.clone());
            if let Some(oldest) = oldest {
                jobs.remove(&oldest);
            }
        }
        let chart = jobs.entry(name.to_owned()).or_insert_with(|| JobChart {
            bytes: Vec::new(),
            svg: None,
            looked: Instant::now(),
            drawn_in: Duration::ZERO,
        });
        chart.looked = Instant::now();
        let grew = fetch_new(&actor, &mut chart.bytes).await?;
        if grew || chart.svg.is_none() {
            let bytes = chart.bytes.clone();
            let job = name.to_owned();
            let started = Instant::now();
            let draw_chart = self.draw_chart;
            let svg = tokio::task::spawn_blocking(move || draw(draw_chart, &job, &bytes))
                .await
                .context("drawing the chart")?;
            chart.drawn_in = started.elapsed();
            chart.svg = Some(Arc::new(svg));
        }
        Ok(chart.svg.clone())
    }
}

/// Appends what the coordinator's file has past `bytes` (from the start again when the
/// file got shorter: a resumed run rewinds it); whether anything changed.
async fn fetch_new(actor: &actors::job::JobHandle, bytes: &mut Vec<u8>) -> anyhow::Result<bool> {
    let mut changed = false;
    loop {
        let piece = call_coordinator(
            actor,
            &MetricsRequest {
                offset: bytes.len() as u64,
                max_bytes: PIECE_BYTES,
            },
            COORDINATOR_CALL_TIMEOUT,
        )
        .await?;
        if piece.length < bytes.len() as u64 {
            bytes.clear();
            changed = true;
            continue;
        }
        if piece.bytes.is_empty() || bytes.len() >= MAX_METRICS_BYTES {
            return Ok(changed);
        }
        changed = true;
        bytes.extend_from_slice(&piece.bytes);
        if bytes.len() as u64 >= piece.length {
            return Ok(changed);
        }
    }
}

/// The SVG of `bytes`, or one that says why there is no chart.
fn draw(draw_chart: super::DrawChart, job: &str, bytes: &[u8]) -> String {
    let why = if bytes.len() >= MAX_METRICS_BYTES {
        format!("metrics.jsonl is over {MAX_METRICS_BYTES} bytes: draw it with `imgrun plot {job}`")
    } else {
        // A file cut mid-line is only a line short: the cut line is skipped.
        match draw_chart(job, bytes, SIZE) {
            Ok(svg) => return svg,
            Err(error) => format!("no chart yet: {error:#}"),
        }
    };
    let text = super::pages::escape(&why);
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"60\" viewBox=\"0 0 {w} \
         60\"><text x=\"10\" y=\"35\" font-family=\"sans-serif\" font-size=\"16\">{text}</text>\
         </svg>",
        w = SIZE.0
    )
}
