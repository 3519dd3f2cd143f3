//! One WebDataset sample: a key, the shard it came from, and its fields by extension.

use std::sync::Arc;

/// A sample: the members of a tar shard that share a key, in the order they were read
/// (or will be written).
///
/// Field names are the lower-cased extensions (`jpg`, `cls`, `seg.png`). A sample read
/// from a shard carries `url`, the shard it came from (`__url__` in Python); one being
/// built for writing leaves it empty.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Sample {
    pub key: String,
    pub url: Arc<str>,
    pub fields: Vec<(String, Vec<u8>)>,
}

impl Sample {
    /// An empty sample for writing.
    pub fn new(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            url: Arc::from(""),
            fields: Vec::new(),
        }
    }

    /// Adds a field (builder style).
    pub fn with(mut self, extension: impl Into<String>, bytes: impl Into<Vec<u8>>) -> Self {
        self.fields.push((extension.into(), bytes.into()));
        self
    }

    /// Adds a `cls` field written as ASCII decimal, as the Python writer does.
    pub fn with_class(self, class: u32) -> Self {
        self.with("cls", class.to_string())
    }

    /// The bytes of a field, by exact extension.
    pub fn field(&self, extension: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find(|(e, _)| e == extension)
            .map(|(_, b)| b.as_slice())
    }

    /// The first field whose extension is one of `extensions` (e.g. `["jpg", "jpeg",
    /// "png"]`), with its extension.
    pub fn first_of<'a>(&'a self, extensions: &[&'a str]) -> Option<(&'a str, &'a [u8])> {
        extensions
            .iter()
            .find_map(|want| self.field(want).map(|b| (*want, b)))
    }

    /// An integer field (`cls`, `index`, ...), decoded as the Python decoder does.
    pub fn int_field(&self, extension: &str) -> Option<Result<i64, String>> {
        self.field(extension).map(decode_int_field)
    }

    /// Total payload bytes of all fields.
    pub fn payload_bytes(&self) -> u64 {
        self.fields.iter().map(|(_, b)| b.len() as u64).sum()
    }
}

/// Decodes an integer field (`cls`, `cls2`, `index`, `inx`, `id`): ASCII decimal,
/// tolerating surrounding whitespace and a trailing newline.
pub fn decode_int_field(bytes: &[u8]) -> Result<i64, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_string())?;
    let trimmed = text.trim();
    trimmed
        .parse::<i64>()
        .map_err(|_| format!("`{}` is not an integer", truncate(trimmed, 32)))
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_fields_decode_like_python() {
        let cases: &[(&[u8], Result<i64, ()>)] = &[
            (b"7", Ok(7)),
            (b" 42\n", Ok(42)),
            (b"-3", Ok(-3)),
            (b"\t0\r\n", Ok(0)),
            (b"", Err(())),
            (b"4 2", Err(())),
            (b"abc", Err(())),
            (&[0xff, 0xfe], Err(())),
        ];
        for (bytes, want) in cases {
            let got = decode_int_field(bytes).map_err(|_| ());
            assert_eq!(&got, want, "decoding {bytes:?}");
        }
    }

    #[test]
    fn fields_are_found_by_extension() {
        let s = Sample::new("k").with("png", b"p".to_vec()).with_class(3);
        assert_eq!(s.field("cls"), Some(&b"3"[..]));
        assert_eq!(s.first_of(&["jpg", "png"]), Some(("png", &b"p"[..])));
        assert_eq!(s.int_field("cls"), Some(Ok(3)));
        assert_eq!(s.int_field("missing"), None);
        assert_eq!(s.payload_bytes(), 2);
    }
}
