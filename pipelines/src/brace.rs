//! Shard specs: brace expansion (`train-{000000..000146}.tar`), `::`-joined lists, and
//! the reverse, compressing a list of names back into brace notation.

use std::collections::BTreeMap;

/// A spec that cannot be expanded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BraceError {
    #[error("unbalanced braces in `{spec}`: `{brace}` at character {position} has no partner")]
    Unbalanced {
        spec: String,
        brace: char,
        position: usize,
    },
    #[error("bad range `{{{range}}}` in `{spec}`: {reason}")]
    BadRange {
        spec: String,
        range: String,
        reason: String,
    },
    #[error("spec `{spec}` would expand to {count} names, over the limit of {limit}")]
    TooMany {
        spec: String,
        count: u64,
        limit: u64,
    },
    #[error("spec `{spec}` nests braces deeper than {limit}")]
    TooDeep { spec: String, limit: usize },
    #[error("empty shard spec")]
    Empty,
}

/// Most names one spec may expand to: counted before anything is expanded, so a typo
/// like `{0..999999999}` costs neither memory nor time. (ImageNet is 1,282 shards; a
/// billion samples at 1,000 per shard is a million.)
const MAX_NAMES: u64 = 1_000_000;

/// Deepest brace nesting accepted (the expansion recurses once per level).
const MAX_DEPTH: usize = 64;

/// Expands a full spec: several brace patterns joined with `::`.
pub fn expand_spec(spec: &str) -> Result<Vec<String>, BraceError> {
    if spec.trim().is_empty() {
        return Err(BraceError::Empty);
    }
    let parts: Vec<&str> = spec.split("::").filter(|p| !p.is_empty()).collect();
    let mut count: u64 = 0;
    for part in &parts {
        count = count.saturating_add(count_names(part)?);
    }
    if count > MAX_NAMES {
        return Err(BraceError::TooMany {
            spec: spec.to_string(),
            count,
            limit: MAX_NAMES,
        });
    }
    let mut names = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    for part in parts {
        names.extend(expand_braces(part)?);
    }
    Ok(names)
}

/// How many names a brace pattern expands to (saturating), without expanding it.
fn count_names(pattern: &str) -> Result<u64, BraceError> {
    let chars: Vec<char> = pattern.chars().collect();
    check_balance(pattern, &chars)?;
    count_in(pattern, &chars)
}

/// Expands one brace pattern: `{a,b}` alternatives, `{0..10}` / `{10..0..2}` / `{a..e}`
/// ranges, nesting, and `\{` escapes. If either bound of a numeric range starts with `0`,
/// all numbers are zero-padded to the width of the longer bound (`{0..10}` gives `00`
/// to `10`). A brace group with neither comma nor range is kept literally.
pub fn expand_braces(pattern: &str) -> Result<Vec<String>, BraceError> {
    let chars: Vec<char> = pattern.chars().collect();
    check_balance(pattern, &chars)?;
    let count = count_in(pattern, &chars)?;
    if count > MAX_NAMES {
        return Err(BraceError::TooMany {
            spec: pattern.to_string(),
            count,
            limit: MAX_NAMES,
        });
    }
    let mut out = Vec::new();
    expand_into(pattern, &chars, String::new(), &mut out)?;
    Ok(out)
}

fn check_balance(spec: &str, chars: &[char]) -> Result<(), BraceError> {
    let mut open = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 1,
            '{' => {
                open.push(i);
                if open.len() > MAX_DEPTH {
                    return Err(BraceError::TooDeep {
                        spec: spec.to_string(),
                        limit: MAX_DEPTH,
                    });
                }
            }
            '}' if open.pop().is_none() => {
                return Err(BraceError::Unbalanced {
                    spec: spec.to_string(),
                    brace: '}',
                    position: i,
                });
            }
            _ => {}
        }
        i += 1;
    }
    match open.last() {
        Some(&position) => Err(BraceError::Unbalanced {
            spec: spec.to_string(),
            brace: '{',
            position,
        }),
        None => Ok(()),
    }
}

fn expand_into(
    spec: &str,
    chars: &[char],
    prefix: String,
    out: &mut Vec<String>,
) -> Result<(), BraceError> {
    let mut prefix = prefix;
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' if i + 1 < chars.len() => {
                prefix.push(chars[i + 1]);
                i += 2;
            }
            '{' => {
                let close = matching_close(chars, i);
                let inner = &chars[i + 1..close];
                let rest = &chars[close + 1..];
                let alternatives = split_top_level(inner);
                let choices: Vec<Vec<char>> = if alternatives.len() > 1 {
                    alternatives
                } else if let Some(range) = parse_range(spec, inner)? {
                    range.items().map(|s| s.chars().collect()).collect()
                } else {
                    // Not a group: keep `{...}` literally and go on after it.
                    prefix.push('{');
                    let mut literal_inner = Vec::new();
                    expand_into(spec, inner, String::new(), &mut literal_inner)?;
                    if literal_inner.len() != 1 {
                        // A literal group containing real groups: expand each variant.
                        for variant in literal_inner {
                            let mut p = prefix.clone();
                            p.push_str(&variant);
                            p.push('}');
                            expand_into(spec, rest, p, out)?;
                        }
                        return Ok(());
                    }
                    prefix.push_str(&literal_inner[0]);
                    prefix.push('}');
                    i = close + 1;
                    continue;
                };
                for choice in choices {
                    let mut expanded = Vec::new();
                    expand_into(spec, &choice, String::new(), &mut expanded)?;
                    for head in expanded {
                        let mut p = prefix.clone();
                        p.push_str(&head);
                        expand_into(spec, rest, p, out)?;
                    }
                }
                return Ok(());
            }
            c => {
                prefix.push(c);
                i += 1;
            }
        }
    }
    out.push(prefix);
    Ok(())
}

/// The names `expand_into` makes of `chars`, counted the same way: a group multiplies
/// what follows it by its own count (the sum of its alternatives', the range's length,
/// or, for a literal group, what its inside expands to).
fn count_in(spec: &str, chars: &[char]) -> Result<u64, BraceError> {
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' if i + 1 < chars.len() => i += 2,
            '{' => {
                let close = matching_close(chars, i);
                let inner = &chars[i + 1..close];
                let rest = &chars[close + 1..];
                let alternatives = split_top_level(inner);
                let heads = if alternatives.len() > 1 {
                    let mut sum: u64 = 0;
                    for alternative in &alternatives {
                        sum = sum.saturating_add(count_in(spec, alternative)?);
                    }
                    sum
                } else if let Some(range) = parse_range(spec, inner)? {
                    range.count()
                } else {
                    count_in(spec, inner)?
                };
                return Ok(heads.saturating_mul(count_in(spec, rest)?));
            }
            _ => i += 1,
        }
    }
    Ok(1)
}

/// Index of the `}` matching the `{` at `open` (balance was checked beforehand).
fn matching_close(chars: &[char], open: usize) -> usize {
    let mut depth = 0;
    let mut i = open;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 1,
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
        i += 1;
    }
    chars.len() - 1
}

/// Splits on commas outside nested braces. Escaped commas stay (with their backslash,
/// which the recursive expansion removes).
fn split_top_level(chars: &[char]) -> Vec<Vec<char>> {
    let mut parts = vec![Vec::new()];
    let mut depth = 0;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\\' if i + 1 < chars.len() => {
                let last = parts.last_mut().expect("parts is never empty");
                last.push(c);
                last.push(chars[i + 1]);
                i += 2;
                continue;
            }
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(Vec::new());
                i += 1;
                continue;
            }
            _ => {}
        }
        parts.last_mut().expect("parts is never empty").push(c);
        i += 1;
    }
    parts
}

/// A brace range: `{a..b[..step]}` of integers or of single letters.
enum Range {
    Numbers {
        from: i64,
        to: i64,
        step: u64,
        width: usize,
    },
    Letters {
        from: u8,
        to: u8,
        step: u64,
    },
}

impl Range {
    fn count(&self) -> u64 {
        match *self {
            Range::Numbers { from, to, step, .. } => (from.abs_diff(to) / step).saturating_add(1),
            Range::Letters { from, to, step } => u64::from(from.abs_diff(to)) / step + 1,
        }
    }

    /// The items, each within the bounds (so the offsets below cannot overflow).
    fn items(&self) -> impl Iterator<Item = String> + '_ {
        (0..self.count()).map(move |k| match *self {
            Range::Numbers {
                from,
                to,
                step,
                width,
            } => {
                let offset = k * step;
                let value = if from <= to {
                    from.saturating_add_unsigned(offset)
                } else {
                    from.saturating_sub_unsigned(offset)
                };
                format!("{value:0width$}")
            }
            Range::Letters { from, to, step } => {
                let offset = u8::try_from(k * step).unwrap_or(u8::MAX);
                let c = if from <= to {
                    from.saturating_add(offset)
                } else {
                    from.saturating_sub(offset)
                };
                (c as char).to_string()
            }
        })
    }
}

/// The range `a..b[..step]` in `inner`, or `None` if `inner` is not a range.
fn parse_range(spec: &str, inner: &[char]) -> Result<Option<Range>, BraceError> {
    let text: String = inner.iter().collect();
    let parts: Vec<&str> = text.split("..").collect();
    if !(parts.len() == 2 || parts.len() == 3) {
        return Ok(None);
    }
    let step = match parts.get(2) {
        Some(s) => match s.trim_start_matches('-').parse::<u64>() {
            Ok(0) => {
                return Err(BraceError::BadRange {
                    spec: spec.to_string(),
                    range: text.clone(),
                    reason: "step must not be zero".to_string(),
                });
            }
            Ok(n) => n,
            Err(_) => return Ok(None),
        },
        None => 1,
    };
    let (left, right) = (parts[0], parts[1]);
    if let (Ok(from), Ok(to)) = (left.parse::<i64>(), right.parse::<i64>()) {
        let padded = [left, right]
            .iter()
            .any(|s| s.starts_with('0') || s.starts_with("-0"));
        let width = if padded {
            left.len().max(right.len())
        } else {
            0
        };
        return Ok(Some(Range::Numbers {
            from,
            to,
            step,
            width,
        }));
    }
    let (mut l, mut r) = (left.chars(), right.chars());
    if let (Some(a), None, Some(b), None) = (l.next(), l.next(), r.next(), r.next())
        && a.is_ascii_alphabetic()
        && b.is_ascii_alphabetic()
    {
        return Ok(Some(Range::Letters {
            from: a as u8,
            to: b as u8,
            step,
        }));
    }
    Ok(None)
}

/// Compresses shard names into a spec that expands back to the same set: names that
/// differ only in their last run of digits (same width) become `{first..last}` ranges.
/// Parts are joined with `::`, so the result is itself a valid spec.
pub fn summarize_names<S: AsRef<str>>(names: &[S]) -> String {
    // (prefix, width, suffix) -> numbers; names without digits stand alone.
    let mut groups: BTreeMap<(String, usize, String), Vec<u64>> = BTreeMap::new();
    let mut singles = Vec::new();
    for name in names {
        let name = name.as_ref();
        match last_digit_run(name) {
            Some((start, end)) => match name[start..end].parse::<u64>() {
                Ok(n) => groups
                    .entry((
                        name[..start].to_string(),
                        end - start,
                        name[end..].to_string(),
                    ))
                    .or_default()
                    .push(n),
                Err(_) => singles.push(name.to_string()),
            },
            None => singles.push(name.to_string()),
        }
    }
    let mut parts = Vec::new();
    for ((prefix, width, suffix), mut numbers) in groups {
        numbers.sort_unstable();
        numbers.dedup();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for n in numbers {
            match runs.last_mut() {
                Some((_, end)) if *end + 1 == n => *end = n,
                _ => runs.push((n, n)),
            }
        }
        for (a, b) in runs {
            let escaped_prefix = escape(&prefix);
            let escaped_suffix = escape(&suffix);
            if a == b {
                parts.push(format!("{escaped_prefix}{a:0width$}{escaped_suffix}"));
            } else {
                parts.push(format!(
                    "{escaped_prefix}{{{a:0width$}..{b:0width$}}}{escaped_suffix}"
                ));
            }
        }
    }
    parts.extend(singles.iter().map(|s| escape(s)));
    parts.join("::")
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '{' | '}' | ',' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn last_digit_run(name: &str) -> Option<(usize, usize)> {
    let bytes = name.as_bytes();
    let end = bytes.iter().rposition(u8::is_ascii_digit)? + 1;
    let start = bytes[..end]
        .iter()
        .rposition(|b| !b.is_ascii_digit())
        .map_or(0, |i| i + 1);
    Some((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(cases: &[(&str, &[&str])]) {
        for (spec, want) in cases {
            let got = expand_spec(spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
            assert_eq!(got, *want, "expanding {spec}");
            let counted: u64 = spec
                .split("::")
                .filter(|p| !p.is_empty())
                .map(|p| count_names(p).expect("counts"))
                .sum();
            assert_eq!(counted, want.len() as u64, "counting {spec}");
        }
    }

    #[test]
    fn ranges_pad_like_the_library() {
        check(&[
            (
                "a-{0..3}.tar",
                &["a-0.tar", "a-1.tar", "a-2.tar", "a-3.tar"],
            ),
            ("{0..10..5}", &["00", "05", "10"]),
            ("{000..002}", &["000", "001", "002"]),
            ("{8..11}", &["8", "9", "10", "11"]),
            ("{3..1}", &["3", "2", "1"]),
            ("{10..0..4}", &["10", "06", "02"]),
            ("{9..12..3}", &["9", "12"]),
            ("{01..3}", &["01", "02", "03"]),
            ("{a..c}", &["a", "b", "c"]),
            ("{-1..1}", &["-1", "0", "1"]),
        ]);
    }

    #[test]
    fn alternatives_nesting_and_literals() {
        check(&[
            ("x", &["x"]),
            ("{a,b}.tar", &["a.tar", "b.tar"]),
            ("{a,b{1..2}}", &["a", "b1", "b2"]),
            ("{a,b}{0..1}", &["a0", "a1", "b0", "b1"]),
            ("{abc}", &["{abc}"]),
            ("x{}y", &["x{}y"]),
            ("\\{a,b\\}", &["{a,b}"]),
            ("{a\\,b,c}", &["a,b", "c"]),
            ("a.tar::b-{1..2}.tar", &["a.tar", "b-1.tar", "b-2.tar"]),
            ("{,x}y", &["y", "xy"]),
            ("{a{1,2}}{x,y}", &["{a1}x", "{a1}y", "{a2}x", "{a2}y"]),
            (
                "{a,{b..c}}-{0..1}",
                &["a-0", "a-1", "b-0", "b-1", "c-0", "c-1"],
            ),
        ]);
    }

    #[test]
    fn bad_specs_are_errors() {
        let cases: &[(&str, &str)] = &[
            ("a-{0..3.tar", "unbalanced"),
            ("a-0..3}.tar", "unbalanced"),
            ("{{a,b}", "unbalanced"),
            ("{0..4..0}", "step"),
            (
                "{0..99999999999}",
                "would expand to 100000000000 names, over the limit of 1000000",
            ),
            // Ten million names: refused by counting, before any is made.
            ("x-{0000000..9999999}.tar", "would expand to 10000000 names"),
            ("{0..999}{0..999}{0..9}", "would expand to 10000000 names"),
            ("{a,b}{0..999999}", "would expand to 2000000 names"),
            // Over the limit only together.
            ("a.tar::{1..1000000}", "would expand to 1000001 names"),
            (
                "{-9223372036854775808..9223372036854775807}",
                "would expand to 18446744073709551615 names",
            ),
            (
                "{0..999999}{0..999999}{0..999999}{0..999999}",
                "would expand to 18446744073709551615 names",
            ),
            ("", "empty"),
        ];
        for (spec, want) in cases {
            let err = expand_spec(spec).expect_err(spec).to_string();
            assert!(err.contains(want), "{spec}: `{err}` lacks `{want}`");
        }
        let deep = format!("{}x{}", "{".repeat(100_000), "}".repeat(100_000));
        let err = expand_spec(&deep).expect_err("deep").to_string();
        assert!(err.contains("nests braces deeper than 64"), "{err}");
        let at_limit = expand_spec("{0..999999}").expect("a million names");
        assert_eq!(at_limit.len(), 1_000_000);
    }

    #[test]
    fn summaries_expand_back_to_the_same_names() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["a-000000.tar", "a-000001.tar", "a-000002.tar"],
                "a-{000000..000002}.tar",
            ),
            (&["a-0.tar", "a-2.tar", "a-3.tar"], "a-0.tar::a-{2..3}.tar"),
            (&["x.tar", "b-1.tar"], "b-1.tar::x.tar"),
            (&["d/{odd}-1.tar"], "d/\\{odd\\}-1.tar"),
        ];
        for (names, want) in cases {
            let spec = summarize_names(names);
            assert_eq!(spec, *want);
            let mut back = expand_spec(&spec).expect("summary expands");
            let mut orig: Vec<String> = names.iter().map(|s| s.to_string()).collect();
            back.sort();
            orig.sort();
            assert_eq!(back, orig, "round trip of {names:?}");
        }
    }
}
