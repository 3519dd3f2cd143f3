//! `imgrun export RUN`: a checkpoint's model as a PyTorch state dict under torchvision's
//! names, in a safetensors file or a `torch.save` archive, for torchvision, timm or
//! transformers to load. `imgrun export tb RUN`: a run's `metrics.jsonl` as TensorBoard
//! event files (what a job writes to `tb/` as it runs, for runs from before it did).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use actors::job::tensorboard;
use actors::train::checkpoint;
use actors::train::weights::{self, WeightsFormat};
use anyhow::Context;

use crate::config::Loaded;

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ExportArgs {
    #[command(subcommand)]
    what: Option<ExportCommand>,
    /// A run folder (a path, or a run's name under train.runs_dir) or a checkpoint
    /// folder.
    #[arg(required = true)]
    run: Option<PathBuf>,
    /// The checkpoint of the run to export (a folder name in its checkpoints/) [default:
    /// the run's latest].
    #[arg(long, value_name = "NAME")]
    checkpoint: Option<String>,
    /// `safetensors` or `pt` [default: from the output's extension, .safetensors or
    /// .pt/.pth].
    #[arg(long)]
    format: Option<String>,
    /// The file to write.
    #[arg(short = 'o', long = "output", value_name = "FILE", required = true)]
    output: Option<PathBuf>,
    /// Tests only: also run the checkpoint's model in eval mode on the float32 NCHW
    /// tensor `images` of this safetensors file, writing its `logits` to --logits-to.
    #[arg(long, hide = true, value_name = "FILE", requires = "logits_to")]
    logits_for: Option<PathBuf>,
    #[arg(long, hide = true, value_name = "FILE", requires = "logits_for")]
    logits_to: Option<PathBuf>,
}

#[derive(Debug, clap::Subcommand)]
pub enum ExportCommand {
    /// Writes a run's metrics.jsonl as a TensorBoard event file (and each rank's, in
    /// rank-N/, when its steps carry the ranks' figures: `train.tensorboard_ranks`).
    Tb(TbArgs),
}

#[derive(Debug, clap::Args)]
pub struct TbArgs {
    /// A run folder (a path, or a run's name under train.runs_dir).
    run: PathBuf,
    /// The folder to write the event file to [default: the run's tb/, if it holds no
    /// event file yet].
    #[arg(short = 'o', long = "output", value_name = "DIR")]
    output: Option<PathBuf>,
}

pub fn run(loaded: &Loaded, args: ExportArgs) -> anyhow::Result<ExitCode> {
    let runs_dir = &loaded.config.train.runs_dir;
    if let Some(ExportCommand::Tb(tb)) = args.what {
        return export_tb(&tb, runs_dir);
    }
    let (Some(run), Some(output)) = (args.run.clone(), args.output.clone()) else {
        anyhow::bail!("imgrun export: say RUN and -o FILE (or `imgrun export tb RUN`)");
    };
    let format = match &args.format {
        Some(name) => name
            .parse::<WeightsFormat>()
            .map_err(|e| anyhow::anyhow!("--format: {e}"))?,
        None => WeightsFormat::of_path(&output).with_context(|| {
            format!(
                "{}: say --format safetensors or --format pt (or name the file .safetensors, \
                 .pt or .pth)",
                output.display()
            )
        })?,
    };
    let dir = checkpoint_dir(&run, args.checkpoint.as_deref(), runs_dir)?;
    let exported = weights::export(&dir, format, &output)?;
    println!(
        "{}: {} tensors of {} ({} classes), {format}, from {}",
        output.display(),
        exported.tensors,
        exported.model,
        exported.classes,
        dir.display()
    );
    if let (Some(images), Some(out)) = (&args.logits_for, &args.logits_to) {
        weights::write_logits(&dir, images, out)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The checkpoint folder RUN and `--checkpoint` name, by the rule `imgrun train --resume` follows
/// ([`checkpoint::resolve`]): a checkpoint folder, or a run folder's latest, or with
/// `--checkpoint NAME` the run's `checkpoints/NAME`. A RUN that is no path is looked for
/// under `runs_dir`.
fn checkpoint_dir(run: &Path, checkpoint: Option<&str>, runs_dir: &str) -> anyhow::Result<PathBuf> {
    let run = run_dir(run, runs_dir)?;
    let path = match checkpoint {
        Some(name) => {
            let path = run.join("checkpoints").join(name);
            anyhow::ensure!(
                path.is_dir(),
                "{}: no checkpoint {name:?} in this run ({} does not exist)",
                run.display(),
                path.display()
            );
            path
        }
        None => run,
    };
    Ok(checkpoint::resolve(&path)?)
}

/// The run folder RUN names: a path, or a run's name under `runs_dir`.
fn run_dir(run: &Path, runs_dir: &str) -> anyhow::Result<PathBuf> {
    if run.exists() {
        return Ok(run.to_path_buf());
    }
    let named = Path::new(runs_dir).join(run);
    anyhow::ensure!(
        run.components().count() == 1 && named.exists(),
        "{}: no such run or checkpoint folder (nor {})",
        run.display(),
        named.display()
    );
    Ok(named)
}

/// `imgrun export tb RUN`.
fn export_tb(args: &TbArgs, runs_dir: &str) -> anyhow::Result<ExitCode> {
    let run = run_dir(&args.run, runs_dir)?;
    let metrics = run.join("metrics.jsonl");
    anyhow::ensure!(
        metrics.is_file(),
        "{}: no metrics.jsonl in this run folder",
        run.display()
    );
    let dir = match &args.output {
        Some(dir) => dir.clone(),
        None => {
            let dir = run.join(tensorboard::TB_DIR);
            let written = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .any(|entry| entry.file_name().to_string_lossy().contains("tfevents"));
            anyhow::ensure!(
                !written,
                "{}: already holds event files (the job wrote them as it ran); give -o DIR to \
                 write another",
                dir.display()
            );
            dir
        }
    };
    let exported = tensorboard::export(&metrics, &dir)?;
    let ranks = match exported.rank_files.len() {
        0 => String::new(),
        n => format!(" (and {n} ranks' runs in rank-N/)"),
    };
    println!(
        "{}: {} events from {}{ranks}\nview them with: tensorboard --logdir {}",
        exported.file.display(),
        exported.events,
        metrics.display(),
        dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
