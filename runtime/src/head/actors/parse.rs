//! The checks of a spawn request from the network: the kind, the process group, the
//! resources (`(name, amount)`), the placement (`pack`, `spread` or `node:<id>`) and the
//! job label, each refused with a message that names the bad value.

use crate::actor::{ActorLabel, RestartPolicy, SpawnRequest};
use crate::membership::NodeId;
use crate::placement::{Resources, Strategy};

/// Limits on what a spawn request names.
const MAX_KIND: usize = 128;
const MAX_GROUP: usize = 64;
const MAX_RESOURCE_NAME: usize = 64;
const MAX_RESOURCES: usize = 32;
const MAX_JOB: usize = 256;

/// What the head does with an `ActorSpawn`: checked, in domain types.
pub(super) fn spawn_request(
    kind: String,
    args: Vec<u8>,
    resources: &[(String, u64)],
    placement: &str,
    process_group: String,
    restart: RestartPolicy,
) -> Result<SpawnRequest, String> {
    if kind.is_empty() || kind.len() > MAX_KIND {
        return Err(format!(
            "bad actor kind '{}': expected 1 to {MAX_KIND} bytes",
            kind.escape_debug()
        ));
    }
    let group_ok = process_group.len() <= MAX_GROUP
        && process_group
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !group_ok {
        return Err(format!(
            "bad process group '{}': expected at most {MAX_GROUP} letters, digits, '-', '_' or '.'",
            process_group.escape_debug()
        ));
    }
    Ok(SpawnRequest {
        kind,
        args,
        resources: parse_resources(resources)?,
        strategy: parse_strategy(placement)?,
        process_group,
        restart,
        label: None,
    })
}

/// A spawn request's job label: a job name of 1 to [`MAX_JOB`] bytes with no control
/// characters (it is printed in `imgrun status`'s table).
pub(super) fn parse_label(job: String, rank: u32) -> Result<ActorLabel, String> {
    if job.is_empty() || job.len() > MAX_JOB || job.chars().any(char::is_control) {
        return Err(format!(
            "bad job label '{}': expected 1 to {MAX_JOB} bytes without control characters",
            job.escape_debug()
        ));
    }
    Ok(ActorLabel::new(job, rank))
}

/// `(name, amount)` pairs as [`Resources`]; names are lower-case words, given once.
fn parse_resources(pairs: &[(String, u64)]) -> Result<Resources, String> {
    if pairs.len() > MAX_RESOURCES {
        return Err(format!(
            "{} resources requested; at most {MAX_RESOURCES}",
            pairs.len()
        ));
    }
    let mut resources = Resources::new();
    let mut seen = std::collections::HashSet::new();
    for (name, amount) in pairs {
        let name_ok = !name.is_empty()
            && name.len() <= MAX_RESOURCE_NAME
            && name.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
            });
        if !name_ok {
            return Err(format!(
                "bad resource name '{}': expected 1 to {MAX_RESOURCE_NAME} lower-case letters, \
                 digits, '-', '_' or '.'",
                name.escape_debug()
            ));
        }
        if !seen.insert(name.as_str()) {
            return Err(format!("resource '{name}' requested twice"));
        }
        resources.set(name.as_str(), *amount);
    }
    Ok(resources)
}

/// `pack`, `spread` or `node:<id>`.
fn parse_strategy(placement: &str) -> Result<Strategy, String> {
    let bad = || {
        format!(
            "bad placement '{}': expected pack, spread or node:<id>",
            placement.escape_debug()
        )
    };
    match placement {
        "pack" => Ok(Strategy::Pack),
        "spread" => Ok(Strategy::Spread),
        other => {
            let id = other.strip_prefix("node:").ok_or_else(bad)?;
            id.parse()
                .map(|id| Strategy::Node(NodeId(id)))
                .map_err(|_| bad())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::placement_text;

    #[test]
    fn job_labels_are_checked() {
        assert_eq!(
            parse_label("run-7".into(), 3),
            Ok(ActorLabel::new("run-7", 3))
        );
        for bad in [String::new(), "a\nb".into(), "x".repeat(MAX_JOB + 1)] {
            let error = parse_label(bad.clone(), 0).expect_err("refused");
            assert!(error.starts_with("bad job label"), "{bad:?}: {error}");
        }
    }

    #[test]
    fn spawn_requests_are_checked_and_name_the_bad_value() {
        let request = |resources: &[(&str, u64)], placement: &str, group: &str, kind: &str| {
            let resources: Vec<(String, u64)> = resources
                .iter()
                .map(|(name, amount)| (name.to_string(), *amount))
                .collect();
            spawn_request(
                kind.to_owned(),
                Vec::new(),
                &resources,
                placement,
                group.to_owned(),
                RestartPolicy::default(),
            )
            .map(|request| (request.resources.to_string(), request.strategy))
        };
        type Case = (
            Result<(String, Strategy), String>,
            Result<(&'static str, Strategy), &'static str>,
        );
        let cases: [Case; 9] = [
            (
                request(&[("gpu", 2), ("cpu", 1500)], "pack", "", "echo"),
                Ok(("2 gpu, 1.5 cpu", Strategy::Pack)),
            ),
            (
                request(&[], "spread", "rank-0.a_b", "echo"),
                Ok(("nothing", Strategy::Spread)),
            ),
            (
                request(&[("tpu", 0)], "node:3", "", "echo"),
                Ok(("nothing", Strategy::Node(NodeId(3)))),
            ),
            (
                request(&[], "fill", "", "echo"),
                Err("bad placement 'fill': expected pack, spread or node:<id>"),
            ),
            (
                request(&[], "node:x", "", "echo"),
                Err("bad placement 'node:x': expected pack, spread or node:<id>"),
            ),
            (
                request(&[("GPU", 1)], "pack", "", "echo"),
                Err(
                    "bad resource name 'GPU': expected 1 to 64 lower-case letters, digits, '-', \
                     '_' or '.'",
                ),
            ),
            (
                request(&[("gpu", 1), ("gpu", 2)], "pack", "", "echo"),
                Err("resource 'gpu' requested twice"),
            ),
            (
                request(&[], "pack", "a b", "echo"),
                Err(
                    "bad process group 'a b': expected at most 64 letters, digits, '-', '_' or \
                     '.'",
                ),
            ),
            (
                request(&[], "pack", "", ""),
                Err("bad actor kind '': expected 1 to 128 bytes"),
            ),
        ];
        for (got, want) in cases {
            let want = want
                .map(|(text, strategy)| (text.to_owned(), strategy))
                .map_err(str::to_owned);
            assert_eq!(got, want);
        }
        for strategy in [Strategy::Pack, Strategy::Spread, Strategy::Node(NodeId(12))] {
            assert_eq!(parse_strategy(&placement_text(strategy)), Ok(strategy));
        }
    }
}
