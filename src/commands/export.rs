//! `imgrun export RUN`: a checkpoint's model as a PyTorch state dict under torchvision's
//! names, in a safetensors file or a `torch.save` archive, for torchvision, timm or
//! transformers to load.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use actors::train::checkpoint;
use actors::train::weights::{self, WeightsFormat};
use anyhow::Context;

use crate::config::Loaded;

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// A run folder (a path, or a run's name under train.runs_dir) or a checkpoint
    /// folder.
    run: PathBuf,
    /// The checkpoint of the run to export (a folder name in its checkpoints/) [default:
    /// the run's latest].
    #[arg(long, value_name = "NAME")]
    checkpoint: Option<String>,
    /// `safetensors` or `pt` [default: from the output's extension, .safetensors or
    /// .pt/.pth].
    #[arg(long)]
    format: Option<String>,
    /// The file to write.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: PathBuf,
    /// Tests only: also run the checkpoint's model in eval mode on the float32 NCHW
    /// tensor `images` of this safetensors file, writing its `logits` to --logits-to.
    #[arg(long, hide = true, value_name = "FILE", requires = "logits_to")]
    logits_for: Option<PathBuf>,
    #[arg(long, hide = true, value_name = "FILE", requires = "logits_for")]
    logits_to: Option<PathBuf>,
}

pub fn run(loaded: &Loaded, args: ExportArgs) -> anyhow::Result<ExitCode> {
    let format = match &args.format {
        Some(name) => name
            .parse::<WeightsFormat>()
            .map_err(|e| anyhow::anyhow!("--format: {e}"))?,
        None => WeightsFormat::of_path(&args.output).with_context(|| {
            format!(
                "{}: say --format safetensors or --format pt (or name the file .safetensors, \
                 .pt or .pth)",
                args.output.display()
            )
        })?,
    };
    let dir = checkpoint_dir(&args, &loaded.config.train.runs_dir)?;
    let exported = weights::export(&dir, format, &args.output)?;
    println!(
        "{}: {} tensors of {} ({} classes), {format}, from {}",
        args.output.display(),
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

/// The checkpoint folder `args` name, by the rule `imgrun train --resume` follows
/// ([`checkpoint::resolve`]): a checkpoint folder, or a run folder's latest, or with
/// `--checkpoint NAME` the run's `checkpoints/NAME`. A RUN that is no path is looked for
/// under `runs_dir`.
fn checkpoint_dir(args: &ExportArgs, runs_dir: &str) -> anyhow::Result<PathBuf> {
    let mut run = args.run.clone();
    if !run.exists() {
        let named = Path::new(runs_dir).join(&args.run);
        anyhow::ensure!(
            args.run.components().count() == 1 && named.exists(),
            "{}: no such run or checkpoint folder (nor {})",
            args.run.display(),
            named.display()
        );
        run = named;
    }
    let path = match &args.checkpoint {
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
