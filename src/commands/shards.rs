//! `imgrun shards ...`: the shard toolkit.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use pipelines::{
    CreateOptions, CreateReport, DecodeLimits, ErrorPolicy, ImageFolder, IndexOptions,
    MANIFEST_FILE, Manifest, ShardList, SynthOptions, VerifyChecks, create_from_folder,
    generate_synthetic, index_shards, summarize_names, summarize_shard, verify_shard,
};

use crate::commands::progress_bar;
use crate::config::Loaded;
use crate::units::{human_bytes, parse_size};

#[derive(Debug, clap::Subcommand)]
pub enum ShardsCommand {
    /// Converts an image folder (SRC/<class>/<image>) into shuffled shards.
    Create(CreateArgs),
    /// Generates the synthetic shapes dataset straight into shards.
    Synth(SynthArgs),
    /// One line per shard: samples, payload bytes, key range, fields.
    Ls(SpecArgs),
    /// Prints every sample: key, field, size and SHA-256 (to diff datasets or sources).
    Dump(SpecArgs),
    /// Compresses shard names (arguments, or lines on stdin) into brace notation.
    Sum {
        /// Shard names; read from standard input when none are given.
        names: Vec<String>,
    },
    /// Reads shards that have no manifest (written by Python webdataset, tarp, ...) from
    /// any source and writes their manifest.json: samples, bytes and class counts per
    /// shard, as `create` writes it. Training and `plan` need it for exact epochs.
    Index(IndexArgs),
    /// Reads every sample, checks that images decode (under training's pixel limit) and
    /// that labels decode and lie in the class range, reports problems.
    Verify {
        #[command(flatten)]
        spec: SpecArgs,
        /// Field every sample must have.
        #[arg(long, default_value = "cls")]
        label: String,
        /// Number of classes: labels must be 0 to N-1 [default: from the manifest.json
        /// beside local shards; without one, labels are not range-checked].
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        classes: Option<u64>,
    },
}

#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    /// Image folder: one sub-folder per class.
    src: PathBuf,
    /// Output folder for the shards, manifest.json and classes.txt, or an
    /// `s3://bucket/prefix/` to upload them to.
    out: PathBuf,
    /// Shard name prefix: OUT/<prefix>-000000.tar, ...
    #[arg(long, default_value = "shards")]
    prefix: String,
    /// Most samples per shard.
    #[arg(long, default_value_t = 100_000)]
    maxcount: u64,
    /// Most payload bytes per shard, as a size with a unit: `1GB` (10^9 bytes), `512MiB`
    /// (2^29 bytes), `300MB`; a bare number is bytes.
    #[arg(long, default_value = "1GB", value_parser = parse_size)]
    maxsize: u64,
    /// Seed of the one-time shuffle.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Re-encode as JPEG with the shorter side scaled down to this many pixels (`--resize
    /// 160` for the small copies progressive resizing reads; images already smaller are
    /// kept as they are).
    #[arg(long)]
    resize: Option<u32>,
    /// JPEG quality when re-encoding.
    #[arg(long, default_value_t = 90)]
    quality: u8,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Debug, clap::Args)]
pub struct SynthArgs {
    /// Output folder, or an `s3://bucket/prefix/` to upload to.
    out: PathBuf,
    #[arg(long, default_value_t = 10)]
    classes: u32,
    #[arg(long, default_value_t = 500)]
    per_class: u32,
    /// Image side in pixels.
    #[arg(long, default_value_t = 64)]
    size: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value = "synth")]
    prefix: String,
    #[arg(long, default_value_t = 1000)]
    maxcount: u64,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Debug, clap::Args)]
pub struct IndexArgs {
    /// Shards: a brace spec such as `data/train-{000000..000146}.tar`, `::`-joined lists,
    /// `http(s)://` URLs or `pipe:COMMAND`.
    spec: String,
    /// A base each name from the spec goes into: where its `%s` is
    /// (`pipe:gsutil cat gs://bucket/%s`), or after it (`http://host:8080/`).
    #[arg(long)]
    base: Option<String>,
    /// Where to write the manifest (a file, or a folder to get manifest.json and
    /// classes.txt; `s3://bucket/key`, or `s3://bucket/prefix/` to get manifest.json)
    /// [default: the shards' folder, for local shards].
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Shards read at once.
    #[arg(long, default_value_t = 8)]
    jobs: usize,
    /// The integer label field counted per class.
    #[arg(long, default_value = "cls")]
    label: String,
}

#[derive(Debug, clap::Args)]
pub struct SpecArgs {
    /// Shards: a brace spec such as `data/train-{000000..000146}.tar`, `::`-joined lists,
    /// `http(s)://` URLs, `pipe:COMMAND`, or `-` for stdin.
    spec: String,
    /// A base each name from the spec goes into: where its `%s` is
    /// (`pipe:curl -s http://host:8080/%s`), or after it (`/data/`, `http://host:8080/`).
    #[arg(long)]
    base: Option<String>,
    /// What to do with bad shards: fail or skip [default: shards.error_policy].
    #[arg(long)]
    on_error: Option<ErrorPolicy>,
}

impl SpecArgs {
    fn urls(&self, loaded: &Loaded) -> anyhow::Result<Vec<String>> {
        spec_urls(loaded, &self.spec, self.base.as_deref())
    }
}

/// The shards of a spec under `--base`, with `s3://` patterns listed.
fn spec_urls(loaded: &Loaded, spec: &str, base: Option<&str>) -> anyhow::Result<Vec<String>> {
    let urls = ShardList::from_spec_with_base(spec, base.unwrap_or(""))
        .with_context(|| format!("shard spec `{spec}`"))?
        .urls;
    Ok(pipelines::Sources::new(loaded.config.source_options()).expand_patterns(urls)?)
}

pub fn run(loaded: &Loaded, command: ShardsCommand) -> anyhow::Result<ExitCode> {
    match command {
        ShardsCommand::Create(args) => create(loaded, args),
        ShardsCommand::Synth(args) => synth(loaded, args),
        ShardsCommand::Ls(spec) => ls(loaded, &spec),
        ShardsCommand::Dump(spec) => dump(loaded, &spec),
        ShardsCommand::Sum { names } => sum(names),
        ShardsCommand::Index(args) => index(loaded, args),
        ShardsCommand::Verify {
            spec,
            label,
            classes,
        } => verify(loaded, &spec, label, classes),
    }
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

fn create(loaded: &Loaded, args: CreateArgs) -> anyhow::Result<ExitCode> {
    let folder = ImageFolder::scan(&args.src)?;
    eprintln!(
        "found {} images in {} classes under {}",
        folder.images.len(),
        folder.classes.len(),
        args.src.display()
    );
    let options = CreateOptions {
        prefix: args.prefix,
        max_count: args.maxcount,
        max_size: args.maxsize,
        seed: args.seed,
        resize: args.resize,
        threads: args.threads.unwrap_or_else(default_threads),
        quality: args.quality,
        s3: loaded.config.s3.options(),
    };
    let bar = progress_bar(folder.images.len() as u64, "create");
    let report = create_from_folder(&folder, &args.out, &options, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    print_report(&report);
    Ok(ExitCode::SUCCESS)
}

fn synth(loaded: &Loaded, args: SynthArgs) -> anyhow::Result<ExitCode> {
    let options = SynthOptions {
        classes: args.classes,
        per_class: args.per_class,
        size: args.size,
        seed: args.seed,
        prefix: args.prefix,
        max_count: args.maxcount,
        threads: args.threads.unwrap_or_else(default_threads),
        s3: loaded.config.s3.options(),
        ..SynthOptions::default()
    };
    let total = u64::from(args.classes) * u64::from(args.per_class);
    let bar = progress_bar(total, "synth");
    let report = generate_synthetic(&args.out, &options, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    print_report(&report);
    Ok(ExitCode::SUCCESS)
}

/// The summary printed after writing shards; the last line is the brace spec.
pub fn print_report(report: &CreateReport) {
    let manifest = &report.manifest;
    println!(
        "wrote {} samples in {} shards ({}), {} classes",
        manifest.total_samples(),
        manifest.shards.len(),
        human_bytes(manifest.total_bytes()),
        manifest.classes.len()
    );
    for shard in &manifest.shards {
        println!(
            "  {:<28} {:>8} samples {:>12}",
            shard.name,
            shard.samples,
            human_bytes(shard.bytes)
        );
    }
    println!("{}", report.spec);
}

fn ls(loaded: &Loaded, spec: &SpecArgs) -> anyhow::Result<ExitCode> {
    let reader = loaded.config.reader(Some(ErrorPolicy::Fail));
    let mut failed = false;
    let (mut samples, mut bytes) = (0, 0);
    for url in spec.urls(loaded)? {
        match summarize_shard(&reader, &url) {
            Ok(s) => {
                let keys = match (&s.first_key, &s.last_key) {
                    (Some(a), Some(b)) => format!("{a}..{b}"),
                    _ => "-".to_string(),
                };
                println!(
                    "{url}\t{} samples\t{} bytes\t{keys}\t{}",
                    s.samples,
                    s.payload_bytes,
                    s.extensions.join(",")
                );
                samples += s.samples;
                bytes += s.payload_bytes;
            }
            Err(error) => {
                failed = true;
                println!("{url}\tERROR {error}");
            }
        }
    }
    eprintln!("total: {samples} samples, {}", human_bytes(bytes));
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn sum(names: Vec<String>) -> anyhow::Result<ExitCode> {
    let names = if names.is_empty() {
        std::io::stdin()
            .lock()
            .lines()
            .collect::<Result<Vec<_>, _>>()
            .context("reading shard names from standard input")?
            .into_iter()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect()
    } else {
        names
    };
    anyhow::ensure!(!names.is_empty(), "no shard names given");
    println!("{}", summarize_names(&names));
    Ok(ExitCode::SUCCESS)
}

fn index(loaded: &Loaded, args: IndexArgs) -> anyhow::Result<ExitCode> {
    let urls = spec_urls(loaded, &args.spec, args.base.as_deref())?;
    anyhow::ensure!(
        !urls.is_empty(),
        "shard spec `{}` names no shards",
        args.spec
    );
    anyhow::ensure!(args.jobs > 0, "--jobs must be at least 1");
    let output = match &args.output {
        Some(path) => path.clone(),
        None => local_folder(&urls).with_context(|| {
            "the shards are not local files in one folder: say where the manifest goes with \
             -o FILE"
        })?,
    };
    let reader = loaded.config.reader(Some(ErrorPolicy::Fail));
    let options = IndexOptions {
        jobs: args.jobs,
        label_field: args.label,
    };
    let bar = progress_bar(urls.len() as u64, "index");
    let manifest = index_shards(&reader, &urls, &options, &|n| bar.inc(n));
    bar.finish_and_clear();
    let manifest = manifest.with_context(|| format!("indexing `{}`", args.spec))?;
    let written = if let Some(url) = output.to_str().filter(|o| pipelines::is_object_url(o)) {
        // A prefix (ending with `/`) gets `manifest.json` under it; else the object itself.
        let url = match url.ends_with('/') {
            true => format!("{url}{}", pipelines::MANIFEST_FILE),
            false => url.to_string(),
        };
        let json = serde_json::to_vec_pretty(&manifest)?;
        pipelines::put_object(&url, json, &loaded.config.s3.options())
            .with_context(|| format!("writing the manifest to {url}"))?;
        PathBuf::from(url)
    } else if output.is_dir() {
        manifest.write_to(&output)?;
        output.join(pipelines::MANIFEST_FILE)
    } else {
        manifest.write_file(&output)?;
        output
    };
    println!(
        "indexed {} shards: {} samples ({}), {} classes",
        manifest.shards.len(),
        manifest.total_samples(),
        human_bytes(manifest.total_bytes()),
        manifest.classes.len()
    );
    println!("wrote {}", written.display());
    Ok(ExitCode::SUCCESS)
}

/// The folder holding every shard of `urls`, when they are all local files in one.
fn local_folder(urls: &[String]) -> Option<PathBuf> {
    let mut folders = urls.iter().map(|url| pipelines::local_folder(url));
    let first = folders.next()??;
    folders
        .all(|folder| folder == Some(first))
        .then(|| first.to_path_buf())
}

fn verify(
    loaded: &Loaded,
    spec: &SpecArgs,
    label: String,
    classes: Option<u64>,
) -> anyhow::Result<ExitCode> {
    let reader = loaded.config.reader(spec.on_error);
    let urls = spec.urls(loaded)?;
    let classes = match classes {
        Some(n) => Some(n),
        None => classes_beside(&urls)?,
    };
    if classes.is_none() {
        eprintln!(
            "labels not range-checked: give --classes N or a manifest.json beside the shards"
        );
    }
    let checks = VerifyChecks {
        label: Some(label),
        classes,
        // Training's limits (`DataSpec`'s transforms use the defaults).
        limits: DecodeLimits::default(),
    };
    let bar = progress_bar(urls.len() as u64, "verify");
    let (mut samples, mut images, mut problems) = (0, 0, 0);
    for url in &urls {
        let report = verify_shard(&reader, url, &checks);
        samples += report.samples;
        images += report.images;
        for problem in &report.problems {
            bar.suspend(|| println!("{problem}"));
        }
        problems += report.problems.len();
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!(
        "verified {} shards: {samples} samples, {images} images, {problems} problems",
        urls.len()
    );
    Ok(if problems == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The number of classes in the manifest.json beside the first shard when it is a local
/// file, as training reads it; none when there is no such file.
fn classes_beside(urls: &[String]) -> anyhow::Result<Option<u64>> {
    let Some(first) = urls.first() else {
        return Ok(None);
    };
    let Some(dir) = pipelines::local_folder(first) else {
        return Ok(None);
    };
    if !dir.join(MANIFEST_FILE).exists() {
        return Ok(None);
    }
    let manifest = Manifest::read_from(dir).context("reading the shards' manifest")?;
    Ok((!manifest.classes.is_empty()).then_some(manifest.classes.len() as u64))
}

fn dump(loaded: &Loaded, spec: &SpecArgs) -> anyhow::Result<ExitCode> {
    use sha2::{Digest, Sha256};
    use std::io::Write;
    let reader = loaded.config.reader(spec.on_error);
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut write_error = None;
    let stats = reader.read_all(&spec.urls(loaded)?, &mut |sample| {
        let mut fields: Vec<_> = sample.fields.iter().collect();
        fields.sort_by(|a, b| a.0.cmp(&b.0));
        for (extension, bytes) in fields {
            let digest = Sha256::digest(bytes);
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            if let Err(e) = writeln!(out, "{}\t{extension}\t{}\t{hex}", sample.key, bytes.len()) {
                write_error = Some(e);
                return std::ops::ControlFlow::Break(());
            }
        }
        std::ops::ControlFlow::Continue(())
    })?;
    if let Some(e) = write_error {
        // A closed pipe (`| head`) is a normal way to stop.
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e).context("writing to standard output");
        }
    }
    out.flush().ok();
    eprintln!(
        "{} samples, {} skipped samples, {} skipped shards",
        stats.samples, stats.skipped_samples, stats.skipped_shards
    );
    for problem in &stats.problems {
        eprintln!("skipped: {problem}");
    }
    Ok(ExitCode::SUCCESS)
}
