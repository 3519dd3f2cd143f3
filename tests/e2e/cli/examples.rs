//! Every job file in `examples/` loads and plans as its own header tells a reader to use
//! it, against small stand-in shards made here: the shards the file names (made with
//! `imgrun shards synth` under the names `imgrun shards create` would write, the file's
//! URL base pointed at them), then the header's `imgrun` commands as printed, with `train`
//! run as `plan` (the same configuration, loaded and planned as `imgrun train` does) and
//! without the commands that need the real dataset or a server (`shards create`,
//! `serve`), which the stand-ins replace.

use std::path::{Path, PathBuf};

use crate::common::{describe, imgrun, run_ok};

#[test]
fn every_example_loads_and_plans_as_its_header_says() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&examples)
        .expect("list examples/")
        .map(|entry| entry.expect("examples/ entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no job files in {}", examples.display());
    for file in &files {
        plan_example(file);
    }
}

/// Makes the stand-ins for `file`, then plans it with `plan --config FILE` and with every
/// `imgrun` command of its header, from a folder where `examples/` is the checkout's.
fn plan_example(file: &Path) {
    let name = format!(
        "examples/{}",
        file.file_name().expect("file name").to_string_lossy()
    );
    let text = std::fs::read_to_string(file).expect("read example");
    let job: toml::Table = text
        .parse()
        .unwrap_or_else(|e| panic!("{name} is not TOML: {e}"));
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path();
    std::os::unix::fs::symlink(file.parent().expect("examples/"), work.join("examples"))
        .expect("link examples/");
    let data = job.get("data").and_then(|d| d.as_table());
    let text_key = |key: &str| {
        data.and_then(|d| d.get(key))
            .and_then(|v| v.as_str())
            .unwrap_or("")
    };
    // A base that is a URL (or a folder of another machine) points at the stand-ins.
    let mut overrides: Vec<String> = Vec::new();
    if !text_key("base").is_empty() {
        overrides.extend([
            "--set".into(),
            format!("data.base={:?}", format!("{}/", work.display())),
        ]);
    }
    let mut specs = vec![text_key("train"), text_key("val")];
    let schedule = data
        .and_then(|d| d.get("size_schedule"))
        .and_then(|s| s.as_array());
    for phase in schedule.into_iter().flatten() {
        if let Some(train) = phase.get("train").and_then(|t| t.as_str()) {
            specs.push(train);
        }
    }
    for spec in specs.into_iter().filter(|s| !s.is_empty()) {
        make_stand_ins(&name, spec, work);
    }

    let mut planned = 0;
    if !text_key("train").is_empty() {
        let config = file.to_str().expect("utf-8 path");
        let mut args = vec!["plan", "--config", config];
        args.extend(overrides.iter().map(String::as_str));
        run_ok(&args, work);
        planned += 1;
    }
    for command in header_commands(&text) {
        let words = shell_words(&command)
            .unwrap_or_else(|e| panic!("{name}: header command `{command}`: {e}"));
        let mut args: Vec<String> = words.into_iter().skip(1).collect();
        match args.first().map(String::as_str) {
            // The real dataset and its server: the stand-ins are what they would give.
            Some("serve") => continue,
            Some("shards") if args.get(1).is_some_and(|a| a == "create") => continue,
            Some("train") | Some("plan") => {
                args[0] = "plan".into();
                args.extend(overrides.iter().cloned());
                planned += 1;
            }
            _ => {}
        }
        let out = imgrun()
            .args(&args)
            .current_dir(work)
            .output()
            .expect("run imgrun");
        assert!(
            out.status.success(),
            "{name}: its header's `{command}` (run as `imgrun {}`) failed:\n{}",
            args.join(" "),
            describe(&out)
        );
    }
    assert!(
        planned > 0,
        "{name} names no data.train and its header shows no `imgrun train` or `imgrun \
         plan` command: a reader cannot tell how to run it"
    );
}

/// Writes `imgrun shards synth` stand-ins, 64 samples each, for every shard `spec` names
/// (relative to `work`), which must be named as `imgrun shards create` writes them:
/// `DIR/PREFIX-000000.tar` onwards, numbered from 0 without a gap.
fn make_stand_ins(example: &str, spec: &str, work: &Path) {
    let names = pipelines::expand_spec(spec)
        .unwrap_or_else(|e| panic!("{example}: shard spec `{spec}`: {e}"));
    let first = Path::new(&names[0]);
    let stem = first
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix("-000000.tar"))
        .unwrap_or_else(|| {
            panic!(
                "{example}: `{spec}` does not start with PREFIX-000000.tar, the first name \
                 `imgrun shards create` writes"
            )
        });
    let folder = work.join(first.parent().unwrap_or(Path::new("")));
    for (i, shard) in names.iter().enumerate() {
        let want = folder.join(format!("{stem}-{i:06}.tar"));
        assert_eq!(
            work.join(shard),
            want,
            "{example}: `{spec}` is not numbered as `imgrun shards create` numbers shards"
        );
    }
    let count = names.len().to_string();
    run_ok(
        &[
            "shards",
            "synth",
            folder.to_str().expect("utf-8 path"),
            "--prefix",
            stem,
            "--classes",
            &count,
            "--per-class",
            "64",
            "--maxcount",
            "64",
            "--size",
            "8",
        ],
        work,
    );
}

/// The `imgrun ...` commands of a job file's leading comment, continuation lines joined.
fn header_commands(text: &str) -> Vec<String> {
    let mut commands = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines().take_while(|l| l.starts_with('#')) {
        let body = line.trim_start_matches('#').trim();
        let part = match current.take() {
            Some(mut open) => {
                open.push(' ');
                open.push_str(body);
                open
            }
            None if body.starts_with("imgrun ") => body.to_string(),
            None => continue,
        };
        match part.strip_suffix('\\') {
            Some(open) => current = Some(open.trim_end().to_string()),
            None => commands.push(part),
        }
    }
    commands
}

/// Splits a command line as a POSIX shell does for plain words, single and double quotes
/// and backslashes (no expansions, which these lines do not use).
pub(crate) fn shell_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => words.extend(word.take()),
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => w.push(c),
                        None => return Err("unclosed single quote".into()),
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => w.push(c),
                            Some(c) => {
                                w.push('\\');
                                w.push(c);
                            }
                            None => return Err("unclosed double quote".into()),
                        },
                        Some(c) => w.push(c),
                        None => return Err("unclosed double quote".into()),
                    }
                }
            }
            '\\' => {
                if let Some(c) = chars.next() {
                    word.get_or_insert_with(String::new).push(c);
                }
            }
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    Ok(words)
}

#[test]
fn shell_words_split_as_a_shell_does() {
    let cases: [(&str, &[&str]); 5] = [
        ("imgrun plan --x 1", &["imgrun", "plan", "--x", "1"]),
        (
            "--set 'data.train=a/{0..1}.tar'",
            &["--set", "data.train=a/{0..1}.tar"],
        ),
        (
            r#"--set data.base='"/mnt/x/"'"#,
            &["--set", r#"data.base="/mnt/x/""#],
        ),
        (r#"a"b c"d e\ f"#, &["ab cd", "e f"]),
        (r#""x \"y\" \n""#, &[r#"x "y" \n"#]),
    ];
    for (line, want) in cases {
        assert_eq!(shell_words(line).expect(line), want, "{line}");
    }
    assert!(shell_words("'open").is_err());
}
