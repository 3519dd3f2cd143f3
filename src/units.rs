//! Human-friendly byte sizes on the command line: `1GB`, `512MiB`, `100000`.

/// Parses a byte size: a number with an optional unit (`K`, `KB`, `KiB`, ... `T`),
/// decimal for `KB`/`MB`/`GB`/`TB` (and bare `K`/`M`/`G`/`T`), binary for `KiB`...
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size (examples: 1GB, 512MiB, 100000)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("`{text}`: unknown size unit `{other}`")),
    };
    let bytes = value * scale;
    if !(0.0..1.8e19).contains(&bytes) {
        return Err(format!("`{text}` is out of range"));
    }
    Ok(bytes as u64)
}

/// Formats a byte count for people (`1.23 GB`): the one rule, in `pipelines`.
pub use pipelines::human_bytes;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        let cases = [
            ("100000", Ok(100_000)),
            ("1GB", Ok(1_000_000_000)),
            ("1.5 MB", Ok(1_500_000)),
            ("512MiB", Ok(512 << 20)),
            ("3k", Ok(3000)),
            ("1 parsec", Err(())),
            ("GB", Err(())),
            ("", Err(())),
        ];
        for (text, want) in cases {
            assert_eq!(parse_size(text).map_err(|_| ()), want, "{text:?}");
        }
    }

    #[test]
    fn bytes_format() {
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1_234_567), "1.23 MB");
    }
}
