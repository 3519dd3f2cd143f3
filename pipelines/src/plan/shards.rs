//! What the planner plans over: input shards with their sample counts, the shard slices
//! that hooks pass around, and the rule that splits a list into parts.

use std::collections::HashMap;

use rhai::ImmutableString;

use crate::manifest::{Manifest, shard_name};

/// One shard of the input list: its URL and, when known, how many samples it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanShard {
    pub url: String,
    pub samples: Option<u64>,
}

impl PlanShard {
    pub fn new(url: impl Into<String>, samples: Option<u64>) -> Self {
        Self {
            url: url.into(),
            samples,
        }
    }

    /// Shards whose sample counts are unknown.
    pub fn from_urls<S: Into<String>>(urls: impl IntoIterator<Item = S>) -> Vec<Self> {
        urls.into_iter().map(|url| Self::new(url, None)).collect()
    }

    /// Shards with their counts from a manifest, matched by file name ([`shard_name`]:
    /// `pipe:curl -s http://h/a-000001.tar` matches `a-000001.tar`).
    /// URLs the manifest does not list keep an unknown count.
    pub fn with_manifest<S: AsRef<str>>(urls: &[S], manifest: &Manifest) -> Vec<Self> {
        let counts: HashMap<&str, u64> = manifest
            .shards
            .iter()
            .map(|s| (s.name.as_str(), s.samples))
            .collect();
        urls.iter()
            .map(|url| {
                let url = url.as_ref();
                Self::new(url, counts.get(shard_name(url)).copied())
            })
            .collect()
    }
}

/// A piece of work for one loader worker: samples `start`, `start + stride`, ... of one
/// shard, at most `take` of them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkItem {
    pub url: String,
    /// First sample (0-based, in the shard's order).
    pub start: u64,
    /// Distance between samples taken; 1 reads the whole shard from `start`.
    pub stride: u64,
    /// Stop after this many samples (`None`: read to the end of the shard).
    pub take: Option<u64>,
    /// Samples this item yields, when the shard's count is known.
    pub samples: Option<u64>,
}

impl WorkItem {
    /// True when the item reads a whole shard.
    pub fn is_whole_shard(&self) -> bool {
        self.start == 0 && self.stride == 1 && self.take.is_none()
    }
}

/// A strided slice of a shard, as hooks receive and return them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Slice {
    /// Shared, so the many copies hooks make cost no allocation.
    pub url: ImmutableString,
    /// Samples in the whole shard.
    pub shard_samples: Option<u64>,
    pub start: u64,
    pub stride: u64,
}

impl Slice {
    pub fn whole(shard: &PlanShard) -> Self {
        Self {
            url: shard.url.as_str().into(),
            shard_samples: shard.samples,
            start: 0,
            stride: 1,
        }
    }

    /// Samples in the slice: `start, start + stride, ...` below the shard's count.
    pub fn len(&self) -> Option<u64> {
        let count = self.shard_samples?;
        Some(match count.checked_sub(self.start) {
            Some(rest) if rest > 0 => rest.div_ceil(self.stride.max(1)),
            _ => 0,
        })
    }

    /// The same slice without its first `skip` samples.
    pub fn skipping(&self, skip: u64) -> Self {
        Self {
            start: self.start.saturating_add(skip.saturating_mul(self.stride)),
            ..self.clone()
        }
    }

    pub fn into_item(self, take: Option<u64>) -> WorkItem {
        let len = self.len();
        let samples = match (len, take) {
            (Some(len), Some(take)) => Some(len.min(take)),
            (len, None) => len,
            (None, Some(_)) => None,
        };
        // A take that does not cut anything is no limit.
        let take = match (len, take) {
            (Some(len), Some(take)) if take >= len => None,
            (_, take) => take,
        };
        WorkItem {
            url: self.url.to_string(),
            start: self.start,
            stride: self.stride,
            take,
            samples,
        }
    }
}

/// One element picked for a part: element `index` of the list, narrowed to every
/// `group`-th of its samples starting at its `offset`-th.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pick {
    pub index: usize,
    pub offset: u64,
    pub group: u64,
}

/// Which elements of a list of `len` go to part `part` of `parts`.
///
/// With at least as many elements as parts, this is WebDataset's rule `list[part::parts]`
/// (whole elements). With fewer, no part is left empty: part `p` shares element
/// `p % len` with the other parts of the same residue, and each takes every `group`-th
/// sample of it, where `group` is how many parts share it and `offset = p / len` is this
/// part's place among them. Every sample goes to exactly one part either way.
pub(crate) fn pick_part(len: usize, part: u64, parts: u64) -> Vec<Pick> {
    if len == 0 || parts == 0 || part >= parts {
        return Vec::new();
    }
    let n = len as u64;
    if n >= parts {
        return (part..n)
            .step_by(usize::try_from(parts).unwrap_or(usize::MAX))
            .map(|index| Pick {
                index: index as usize,
                offset: 0,
                group: 1,
            })
            .collect();
    }
    let index = part % n;
    vec![Pick {
        index: index as usize,
        offset: part / n,
        group: (parts - index - 1) / n + 1,
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pick_part_follows_the_webdataset_rule_and_never_starves() {
        // (len, parts, picks per part as (index, offset, group))
        /// Per part, the picks as (index, offset, group).
        type Picks = &'static [&'static [(usize, u64, u64)]];
        let cases: &[(usize, u64, Picks)] = &[
            (
                10,
                3,
                &[
                    &[(0, 0, 1), (3, 0, 1), (6, 0, 1), (9, 0, 1)],
                    &[(1, 0, 1), (4, 0, 1), (7, 0, 1)],
                    &[(2, 0, 1), (5, 0, 1), (8, 0, 1)],
                ],
            ),
            (3, 3, &[&[(0, 0, 1)], &[(1, 0, 1)], &[(2, 0, 1)]]),
            (2, 3, &[&[(0, 0, 2)], &[(1, 0, 1)], &[(0, 1, 2)]]),
            (
                1,
                4,
                &[&[(0, 0, 4)], &[(0, 1, 4)], &[(0, 2, 4)], &[(0, 3, 4)]],
            ),
            (0, 2, &[&[], &[]]),
        ];
        for (len, parts, want) in cases {
            for (part, want) in want.iter().enumerate() {
                let got: Vec<_> = pick_part(*len, part as u64, *parts)
                    .into_iter()
                    .map(|p| (p.index, p.offset, p.group))
                    .collect();
                assert_eq!(&got, want, "len {len} part {part} of {parts}");
            }
        }
    }

    #[test]
    fn slice_lengths_and_items() {
        let slice = |samples, start, stride| Slice {
            url: "a.tar".into(),
            shard_samples: samples,
            start,
            stride,
        };
        let cases = [
            (slice(Some(10), 0, 1), Some(10)),
            (slice(Some(10), 1, 3), Some(3)),
            (slice(Some(10), 9, 2), Some(1)),
            (slice(Some(10), 10, 1), Some(0)),
            (slice(Some(10), 12, 1), Some(0)),
            (slice(None, 0, 1), None),
        ];
        for (s, want) in cases {
            assert_eq!(s.len(), want, "{s:?}");
        }
        let item = slice(Some(10), 1, 3).skipping(1).into_item(Some(5));
        assert_eq!((item.start, item.take, item.samples), (4, None, Some(2)));
        let item = slice(Some(10), 0, 1).into_item(Some(4));
        assert_eq!((item.take, item.samples), (Some(4), Some(4)));
    }
}
