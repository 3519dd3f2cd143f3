//! The name a shard is known by, from its URL alone: what a manifest counts it under and
//! what a preloaded copy is called. A leaf: it uses nothing of the crate.

/// The name a manifest knows a shard by: the file name in its URL. For a `pipe:` command
/// it is taken from the command's last word that holds `.tar` (else its last word), so
/// `pipe:curl -s http://h/d/a-000001.tar -o -` is `a-000001.tar`; a URL's query and
/// fragment are left out.
pub fn shard_name(url: &str) -> &str {
    let location = match url.strip_prefix("pipe:") {
        Some(command) => {
            let words: Vec<&str> = command
                .split_whitespace()
                .map(|w| w.trim_matches(|c| c == '\'' || c == '"'))
                .collect();
            words
                .iter()
                .rev()
                .find(|w| w.contains(".tar"))
                .or(words.last())
                .copied()
                .unwrap_or(command)
        }
        None => url,
    };
    let location = if location.contains("://") {
        location.split(['?', '#']).next().unwrap_or(location)
    } else {
        location
    };
    location.rsplit('/').next().unwrap_or(location)
}
