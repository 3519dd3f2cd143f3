//! The README's commands against the real command line: every `imgrun` command in its
//! ```sh, ```bash and ```console blocks (also those run by `srun`, `torchrun`, `ssh` or a
//! pipe) must parse with [`Cli`], flags and values, so a flag renamed in the code and not
//! in the README fails here. A block with such commands must say, in an HTML comment
//! just before it, which tests run what it shows (`<!-- illustration: covered by
//! tests/e2e/cli.rs::name, tests/e2e/train/basics.rs::other -->`), and each named test must exist.
//!
//! Placeholders a reader fills in are allowed: a `...` word (left out), optional parts in
//! brackets (`[--resize 160]`, `[--policy join|drop]`: kept, the first choice taken) and
//! `<token>` values.

use clap::Parser;

use crate::Cli;

const README: &str = include_str!("../README.md");

/// One `imgrun` command of the README: its line, the block's marker, and its words.
struct ReadmeCommand {
    line: usize,
    text: String,
    words: Vec<String>,
}

#[test]
fn every_readme_command_parses_with_the_real_command_line() {
    let (commands, _) = readme_commands(README);
    assert!(
        commands.len() > 20,
        "found only {} imgrun commands in README.md: is the extraction broken?",
        commands.len()
    );
    let failures: Vec<String> = commands
        .iter()
        .filter_map(|command| {
            let argv = std::iter::once("imgrun".to_string()).chain(command.words.clone());
            Cli::try_parse_from(argv).err().map(|error| {
                format!(
                    "README.md:{}: `{}`:\n{}",
                    command.line,
                    command.text,
                    error.render()
                )
            })
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_readme_block_of_commands_names_tests_that_exist() {
    let (_, blocks) = readme_commands(README);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut problems = Vec::new();
    for block in blocks {
        let Some(marker) = block.marker else {
            problems.push(format!(
                "README.md:{}: a block of imgrun commands without an \
                 `<!-- illustration: covered by tests/FILE.rs::test -->` line before it",
                block.line
            ));
            continue;
        };
        for item in marker.split(',').map(str::trim) {
            let Some((file, test)) = item.split_once("::") else {
                problems.push(format!(
                    "README.md:{}: `{item}` is not FILE::test",
                    block.line
                ));
                continue;
            };
            let source = std::fs::read_to_string(root.join(file)).unwrap_or_default();
            if !source.contains(&format!("fn {test}(")) {
                problems.push(format!(
                    "README.md:{}: {file} has no test `{test}`",
                    block.line
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn commands_are_found_wherever_a_line_runs_them() {
    let readme = "\
<!-- illustration: covered by tests/cli.rs::a -->
```sh
imgrun shards ls 'a-{0..1}.tar'   # a comment
srun imgrun train --config job.toml
torchrun --nnodes 2 --no-python \\
    target/release/imgrun train --config job.toml
ls out/*.tar | imgrun shards sum
imgrun plan ... --mode split [--policy join|drop]
ssh gpu01 \"RANK=0 imgrun train --name r50\" & done; wait
make demo
```
```text
imgrun not a command
```
";
    let (commands, blocks) = readme_commands(readme);
    let words: Vec<String> = commands.iter().map(|c| c.words.join(" ")).collect();
    assert_eq!(
        words,
        [
            "shards ls a-{0..1}.tar",
            "train --config job.toml",
            "train --config job.toml",
            "shards sum",
            "plan --mode split --policy join",
            "train --name r50",
        ]
    );
    assert_eq!(commands[2].line, 5, "a command is placed at its first line");
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].marker.as_deref(), Some("tests/cli.rs::a"));
}

/// A block holding `imgrun` commands, with the marker before it.
struct Block {
    line: usize,
    marker: Option<String>,
}

/// Where the reader of the README is.
enum State {
    Prose,
    Shell(Block),
    OtherBlock,
}

/// The README's `imgrun` commands, and the blocks that hold them.
fn readme_commands(readme: &str) -> (Vec<ReadmeCommand>, Vec<Block>) {
    let mut commands: Vec<ReadmeCommand> = Vec::new();
    let mut blocks = Vec::new();
    let mut marker: Option<String> = None;
    let mut state = State::Prose;
    let mut pending: Option<(usize, String)> = None;
    for (index, raw) in readme.lines().enumerate() {
        let number = index + 1;
        let trimmed = raw.trim();
        state = match state {
            State::Prose => {
                if let Some(fence) = trimmed.strip_prefix("```") {
                    if ["sh", "bash", "console"].contains(&fence) {
                        State::Shell(Block {
                            line: number,
                            marker: marker.take(),
                        })
                    } else {
                        State::OtherBlock
                    }
                } else {
                    if let Some(rest) = trimmed.strip_prefix("<!-- illustration: covered by ") {
                        marker = rest.strip_suffix("-->").map(|m| m.trim().to_string());
                    } else if !trimmed.is_empty() {
                        marker = None;
                    }
                    State::Prose
                }
            }
            State::OtherBlock if trimmed == "```" => State::Prose,
            State::OtherBlock => State::OtherBlock,
            State::Shell(block) if trimmed == "```" => {
                if commands.last().is_some_and(|c| c.line > block.line) {
                    blocks.push(block);
                }
                pending = None;
                marker = None;
                State::Prose
            }
            State::Shell(block) => {
                let text = raw.trim_end();
                let (start, joined) = match pending.take() {
                    Some((start, mut open)) => {
                        open.push(' ');
                        open.push_str(text.trim_start());
                        (start, open)
                    }
                    None => (number, text.to_string()),
                };
                if let Some(open) = joined.strip_suffix('\\') {
                    pending = Some((start, open.to_string()));
                } else {
                    for words in imgrun_invocations(&joined) {
                        commands.push(ReadmeCommand {
                            line: start,
                            text: joined.trim().to_string(),
                            words,
                        });
                    }
                }
                State::Shell(block)
            }
        };
    }
    (commands, blocks)
}

/// The words after every `imgrun` (or `target/release/imgrun`, or a path ending in
/// `/imgrun`) in one shell line, each up to the end of its command (`|`, `;`, `&`, a
/// comment, or the quote the command sits in), placeholders resolved.
fn imgrun_invocations(line: &str) -> Vec<Vec<String>> {
    let line = line
        .replace("\"$(which imgrun)\"", "imgrun")
        .replace("\"$(command -v imgrun)\"", "imgrun");
    let mut found = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = find_program(rest) {
        let after = &rest[at..];
        let args = after.split_once(' ').map(|(_, a)| a).unwrap_or("");
        let end = command_end(args);
        found.push(resolve_placeholders(&args[..end]));
        rest = &args[end..];
    }
    found
}

/// Where the next `imgrun` program word (`imgrun`, or a path ending in `/imgrun`)
/// starts in `text`, outside a comment.
fn find_program(text: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(offset) = text[from..].find("imgrun ") {
        let at = from + offset;
        let word_start = text[..at]
            .rfind([' ', '"', '\'', '(', '|', ';', '&'])
            .map_or(0, |i| i + 1);
        let prefix = &text[word_start..at];
        let is_comment = text[..at].contains('#');
        if (prefix.is_empty() || prefix.ends_with('/')) && !is_comment {
            return Some(word_start);
        }
        from = at + "imgrun ".len();
    }
    None
}

/// The length of the command that starts `args`: up to an unquoted `|`, `;`, `&`, ` #`,
/// or a `"` that closes the quote the whole command sits in.
fn command_end(args: &str) -> usize {
    let mut quote: Option<char> = None;
    let mut previous = ' ';
    for (i, c) in args.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'') => quote = Some('\''),
            (None, '"') => {
                // A quote that opens a word; one after a word's end closes an outer one.
                if previous == ' ' || previous == '=' {
                    quote = Some('"');
                } else {
                    return i;
                }
            }
            (None, '|' | ';' | '&') => return i,
            (None, '#') if previous == ' ' => return i,
            _ => {}
        }
        previous = c;
    }
    args.len()
}

/// Shell words of `args` with the README's placeholders resolved: `...` dropped,
/// `[--flag a|b]` kept with its first choice.
fn resolve_placeholders(args: &str) -> Vec<String> {
    let mut text = String::new();
    let mut in_optional = false;
    let mut skipping_choices = false;
    for c in args.chars() {
        match c {
            '[' if !in_optional => in_optional = true,
            ']' if in_optional => {
                in_optional = false;
                skipping_choices = false;
            }
            '|' if in_optional => skipping_choices = true,
            ' ' if skipping_choices => {
                skipping_choices = false;
                text.push(c);
            }
            _ if skipping_choices => {}
            _ => text.push(c),
        }
    }
    split_words(&text)
        .into_iter()
        .filter(|word| word != "...")
        .collect()
}

/// Splits shell words: single and double quotes, backslashes; no expansions.
fn split_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote: Option<char> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') => {
                let next = chars.next().unwrap_or('\\');
                let w = word.get_or_insert_with(String::new);
                if !matches!(next, '"' | '\\' | '$' | '`') {
                    w.push('\\');
                }
                w.push(next);
            }
            (Some(_), c) => word.get_or_insert_with(String::new).push(c),
            (None, ' ' | '\t') => words.extend(word.take()),
            (None, '\'' | '"') => {
                word.get_or_insert_with(String::new);
                quote = Some(c);
            }
            (None, '\\') => {
                if let Some(next) = chars.next() {
                    word.get_or_insert_with(String::new).push(next);
                }
            }
            (None, c) => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    words
}
