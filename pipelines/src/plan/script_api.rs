//! What hook scripts see: the sandboxed engine and its packages, `ctx` with its seeded
//! generator `ctx.rng`, the `split_part` helper, and shards as Rhai values; and the
//! [`HookLimits`] it runs under. Below `hooks.rs`, which loads and calls the scripts.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use rhai::packages::{
    ArithmeticPackage, BasicArrayPackage, BasicFnPackage, BasicIteratorPackage, BasicMapPackage,
    BasicMathPackage, BasicStringPackage, LogicPackage, MoreStringPackage, Package,
};
use rhai::{Array, Dynamic, Engine, EvalAltResult, INT, ImmutableString, Map};

use super::rng::SplitMix64;
use super::shards::{Slice, pick_part};

/// Limits every hook call runs under. Exceeding one fails the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookLimits {
    /// Rhai operations per hook call (an endless loop stops here).
    pub max_operations: u64,
    /// Nested function calls.
    pub max_call_levels: usize,
    /// Nesting of expressions (and, separately, inside functions).
    pub max_expr_depth: usize,
    /// String bytes in one value. Rhai adds up every string inside an array or map, so an
    /// array of URLs counts all of them.
    pub max_string_size: usize,
    /// Array elements in one value (nested arrays included): must hold the shard list.
    pub max_array_size: usize,
    /// Object map properties in one value (nested maps included).
    pub max_map_size: usize,
}

impl Default for HookLimits {
    fn default() -> Self {
        Self {
            max_operations: 1_000_000,
            max_call_levels: 32,
            max_expr_depth: 64,
            max_string_size: 16 << 20,
            max_array_size: 1_000_000,
            max_map_size: 1_000_000,
        }
    }
}

/// What a hook sees as `ctx`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HookContext {
    pub rank: u32,
    pub world_size: u32,
    pub node_rank: u32,
    pub num_nodes: u32,
    pub local_rank: u32,
    pub ranks_per_node: u32,
    pub worker: u32,
    pub workers: u32,
    pub epoch: u64,
    pub pass: u64,
    pub seed: u64,
    pub mode: &'static str,
    pub shuffle: bool,
    /// Seed of `ctx.rng` before `reseed` runs.
    pub rng_seed: u64,
}

impl HookContext {
    pub fn to_map(&self, rng: &ScriptRng) -> Map {
        let int = |x: u64| Dynamic::from_int(x as INT);
        let mut map = Map::new();
        map.insert("rank".into(), int(self.rank.into()));
        map.insert("world_size".into(), int(self.world_size.into()));
        map.insert("node_rank".into(), int(self.node_rank.into()));
        map.insert("num_nodes".into(), int(self.num_nodes.into()));
        map.insert("local_rank".into(), int(self.local_rank.into()));
        map.insert("ranks_per_node".into(), int(self.ranks_per_node.into()));
        map.insert("worker".into(), int(self.worker.into()));
        map.insert("workers".into(), int(self.workers.into()));
        map.insert("epoch".into(), int(self.epoch));
        map.insert("pass".into(), int(self.pass));
        // The same 64 bits, read as a signed Rhai integer.
        map.insert("seed".into(), int(self.seed));
        map.insert("mode".into(), self.mode.into());
        map.insert("shuffle".into(), self.shuffle.into());
        map.insert("rng".into(), Dynamic::from(rng.clone()));
        map
    }
}

/// `ctx.rng`: a handle on the worker's generator. Rhai passes values by copy, so the
/// handle shares its state: `ctx.rng.set_seed(x)` in one hook is seen by the next.
#[derive(Debug, Clone)]
pub(crate) struct ScriptRng(Arc<Mutex<SplitMix64>>);

impl ScriptRng {
    pub fn new(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(SplitMix64::new(seed))))
    }

    fn with<R>(&self, f: impl FnOnce(&mut SplitMix64) -> R) -> R {
        // A panic cannot happen while the lock is held (the closures below do not
        // panic), and the state is valid whatever happened, so poisoning is ignored.
        let mut rng = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut rng)
    }

    pub fn snapshot(&self) -> SplitMix64 {
        self.with(|rng| rng.clone())
    }
}

pub(crate) fn sandboxed_engine(limits: &HookLimits) -> Engine {
    // A raw engine has no functions at all; add only pure data packages. Left out on
    // purpose: `LanguageCorePackage` (`sleep`, `exit`), time, blobs, debugging. No
    // module resolver exists (`no_module`), and Rhai itself has no file or network access.
    let mut engine = Engine::new_raw();
    ArithmeticPackage::new().register_into_engine(&mut engine);
    LogicPackage::new().register_into_engine(&mut engine);
    BasicStringPackage::new().register_into_engine(&mut engine);
    MoreStringPackage::new().register_into_engine(&mut engine);
    BasicIteratorPackage::new().register_into_engine(&mut engine);
    BasicFnPackage::new().register_into_engine(&mut engine);
    BasicMathPackage::new().register_into_engine(&mut engine);
    BasicArrayPackage::new().register_into_engine(&mut engine);
    BasicMapPackage::new().register_into_engine(&mut engine);
    engine.disable_symbol("eval");
    engine
        .set_max_operations(limits.max_operations)
        .set_max_call_levels(limits.max_call_levels)
        .set_max_expr_depths(limits.max_expr_depth, limits.max_expr_depth)
        .set_max_string_size(limits.max_string_size)
        .set_max_array_size(limits.max_array_size)
        .set_max_map_size(limits.max_map_size)
        .set_max_variables(1_000)
        .set_max_functions(1_000)
        .set_strict_variables(true)
        .set_fail_on_invalid_map_property(true);
    engine.on_print(|text| tracing::debug!(text, "hook print"));
    engine.on_debug(|text, _source, position| tracing::debug!(text, %position, "hook debug"));

    engine.register_type_with_name::<ScriptRng>("Rng");
    // Not `reseed`: Rhai resolves `x.reseed(y)` to a script function `reseed(y)` first,
    // so inside reseed.rhai that name would call the hook itself.
    engine.register_fn("set_seed", |rng: &mut ScriptRng, seed: INT| {
        rng.with(|r| *r = SplitMix64::new(seed as u64));
    });
    engine.register_fn(
        "next_int",
        |rng: &mut ScriptRng, n: INT| -> Result<INT, Box<EvalAltResult>> {
            if n <= 0 {
                return Err(format!("rng.next_int({n}): the bound must be positive").into());
            }
            Ok(rng.with(|r| r.below(n as u64)) as INT)
        },
    );
    engine.register_fn("next_float", |rng: &mut ScriptRng| {
        rng.with(SplitMix64::next_f64)
    });
    engine.register_fn("shuffle", |rng: &mut ScriptRng, mut list: Array| {
        rng.with(|r| r.shuffle(&mut list));
        list
    });
    register_shard(&mut engine);
    engine.register_fn("split_part", split_part);
    engine
}

/// A shard (or a strided slice of one) as scripts see it: a `Shard` value with
/// properties `url`, `samples` (`()` when unknown), `start` and `stride` (both settable).
/// Opaque to Rhai's size checks, so a list of them costs one unit per shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScriptShard {
    url: ImmutableString,
    samples: Option<u64>,
    start: u64,
    stride: u64,
}

impl fmt::Display for ScriptShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.url)?;
        if self.start != 0 || self.stride != 1 {
            write!(f, "[{}::{}]", self.start, self.stride)?;
        }
        Ok(())
    }
}

fn register_shard(engine: &mut Engine) {
    fn at_least(what: &str, min: INT, value: INT) -> Result<u64, Box<EvalAltResult>> {
        if value < min {
            return Err(format!("shard.{what} must be at least {min}, found {value}").into());
        }
        Ok(value as u64)
    }
    engine.register_type_with_name::<ScriptShard>("Shard");
    engine.register_get("url", |s: &mut ScriptShard| s.url.clone());
    engine.register_get("samples", |s: &mut ScriptShard| {
        s.samples
            .map_or(Dynamic::UNIT, |n| Dynamic::from_int(n as INT))
    });
    engine.register_get_set(
        "start",
        |s: &mut ScriptShard| s.start as INT,
        |s: &mut ScriptShard, v: INT| -> Result<(), Box<EvalAltResult>> {
            s.start = at_least("start", 0, v)?;
            Ok(())
        },
    );
    engine.register_get_set(
        "stride",
        |s: &mut ScriptShard| s.stride as INT,
        |s: &mut ScriptShard, v: INT| -> Result<(), Box<EvalAltResult>> {
            s.stride = at_least("stride", 1, v)?;
            Ok(())
        },
    );
    engine.register_fn("to_string", |s: &mut ScriptShard| s.to_string());
    engine.register_fn("to_debug", |s: &mut ScriptShard| format!("Shard({s})"));
    engine.register_fn("==", |a: &mut ScriptShard, b: ScriptShard| *a == b);
    engine.register_fn("!=", |a: &mut ScriptShard, b: ScriptShard| *a != b);
}

/// `split_part(shards, part, parts)`: the part's share of a list (see `pick_part`).
fn split_part(list: Array, part: INT, parts: INT) -> Result<Array, Box<EvalAltResult>> {
    if parts <= 0 || part < 0 || part >= parts {
        return Err(format!("split_part: part {part} of {parts} does not exist").into());
    }
    let picks = pick_part(list.len(), part as u64, parts as u64);
    let mut out = Array::with_capacity(picks.len());
    for pick in picks {
        let item = list[pick.index].clone();
        if pick.group == 1 {
            out.push(item);
            continue;
        }
        // Narrow a slice: keep every `group`-th of its samples, from the `offset`-th.
        let mut shard = script_shard(item).map_err(|problem| format!("split_part: {problem}"))?;
        shard.start = shard
            .start
            .saturating_add(pick.offset.saturating_mul(shard.stride));
        shard.stride = shard.stride.saturating_mul(pick.group);
        out.push(Dynamic::from(shard));
    }
    Ok(out)
}

pub(crate) fn slice_to_dynamic(slice: &Slice) -> Dynamic {
    Dynamic::from(ScriptShard {
        url: slice.url.clone(),
        samples: slice.shard_samples,
        start: slice.start,
        stride: slice.stride,
    })
}

/// A returned element as a slice; a count it does not carry comes from the input
/// shard with the same URL. Its URL must be one of the input shards': hooks select,
/// reorder, repeat and slice the shards they are given, and never name others (a
/// `pipe:` URL would run a command on every trainer).
pub(crate) fn dynamic_to_slice(
    value: Dynamic,
    known: &HashMap<String, Option<u64>>,
) -> Result<Slice, String> {
    let shard = script_shard(value)?;
    if shard.url.is_empty() {
        return Err("empty URL".to_string());
    }
    let Some(input_samples) = known.get(shard.url.as_str()) else {
        return Err(format!(
            "`{}` is not one of the configured shards (a hook may only select, reorder \
             and repeat the shards it is given)",
            crate::error::escaped(shard.url.as_bytes())
        ));
    };
    let shard_samples = shard.samples.or(*input_samples);
    Ok(Slice {
        url: shard.url,
        shard_samples,
        start: shard.start,
        stride: shard.stride,
    })
}

/// A `Shard`, a URL string, or a map with `url` and optionally `samples`, `start`,
/// `stride`.
fn script_shard(value: Dynamic) -> Result<ScriptShard, String> {
    let type_name = value.type_name();
    if value.is::<ScriptShard>() {
        return value
            .try_cast::<ScriptShard>()
            .ok_or_else(|| format!("expected a Shard, found {type_name}"));
    }
    if value.is_string() {
        let url = value
            .into_immutable_string()
            .map_err(|t| format!("expected a string, found {t}"))?;
        return Ok(ScriptShard {
            url,
            samples: None,
            start: 0,
            stride: 1,
        });
    }
    let Some(map) = value.try_cast::<Map>() else {
        return Err(format!(
            "expected a Shard, a URL string or a map with `url`, found {type_name}"
        ));
    };
    if let Some(key) = map
        .keys()
        .find(|k| !["url", "samples", "start", "stride"].contains(&k.as_str()))
    {
        return Err(format!(
            "unknown key `{key}` (expected url, samples, start, stride)"
        ));
    }
    let url = match map.get("url") {
        Some(url) if url.is_string() => url.clone().into_immutable_string().unwrap_or_default(),
        Some(other) => {
            return Err(format!(
                "`url` must be a string, found {}",
                other.type_name()
            ));
        }
        None => return Err("missing `url`".to_string()),
    };
    let int = |key: &str, min: INT| -> Result<Option<u64>, String> {
        match map.get(key) {
            None => Ok(None),
            Some(v) if v.is_unit() => Ok(None),
            Some(v) => match v.as_int() {
                Ok(n) if n >= min => Ok(Some(n as u64)),
                Ok(n) => Err(format!("`{key}` must be at least {min}, found {n}")),
                Err(t) => Err(format!("`{key}` must be an integer, found {t}")),
            },
        }
    };
    Ok(ScriptShard {
        url,
        samples: int("samples", 0)?,
        start: int("start", 0)?.unwrap_or(0),
        stride: int("stride", 1)?.unwrap_or(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_part_narrows_slices_and_rejects_bad_parts() {
        let list: Array = vec!["a.tar".into()];
        let got = split_part(list.clone(), 1, 3).expect("valid part");
        let shard = got[0].clone().try_cast::<ScriptShard>().expect("a Shard");
        assert_eq!((shard.start, shard.stride), (1, 3));
        assert_eq!(shard.to_string(), "a.tar[1::3]");
        // Narrowing a slice again composes: every 3rd of every 2nd, from the 1st.
        let slice = Dynamic::from(ScriptShard {
            url: "b.tar".into(),
            samples: Some(9),
            start: 1,
            stride: 2,
        });
        let got = split_part(vec![slice], 2, 3).expect("valid part");
        let shard = got[0].clone().try_cast::<ScriptShard>().expect("a Shard");
        assert_eq!((shard.start, shard.stride, shard.samples), (5, 6, Some(9)));
        for (part, parts) in [(3, 3), (-1, 3), (0, 0)] {
            assert!(
                split_part(list.clone(), part, parts).is_err(),
                "{part} of {parts}"
            );
        }
    }

    #[test]
    fn returned_shards_are_validated() {
        let known: HashMap<String, Option<u64>> =
            [("a.tar".to_string(), Some(10)), ("b.tar".to_string(), None)].into();
        let map = |pairs: &[(&str, Dynamic)]| {
            let mut m = Map::new();
            for (k, v) in pairs {
                m.insert((*k).into(), v.clone());
            }
            Dynamic::from_map(m)
        };
        let good = [
            (Dynamic::from("a.tar"), (Some(10), 0, 1)),
            (Dynamic::from("b.tar"), (None, 0, 1)),
            (
                slice_to_dynamic(&Slice {
                    url: "a.tar".into(),
                    shard_samples: None,
                    start: 1,
                    stride: 2,
                }),
                (Some(10), 1, 2),
            ),
            (
                map(&[
                    ("url", "a.tar".into()),
                    ("start", 2.into()),
                    ("stride", 3.into()),
                ]),
                (Some(10), 2, 3),
            ),
            (
                map(&[("url", "b.tar".into()), ("samples", 5.into())]),
                (Some(5), 0, 1),
            ),
        ];
        for (value, want) in good {
            let slice = dynamic_to_slice(value, &known).expect("valid shard");
            assert_eq!((slice.shard_samples, slice.start, slice.stride), want);
        }
        let bad = [
            (Dynamic::from(3_i64), "found i64"),
            (Dynamic::from(""), "empty URL"),
            (map(&[("start", 1.into())]), "missing `url`"),
            (map(&[("url", 1.into())]), "`url` must be a string"),
            (
                Dynamic::from("pipe:touch /tmp/owned"),
                "`pipe:touch /tmp/owned` is not one of the configured shards",
            ),
            (
                map(&[("url", "c.tar".into()), ("samples", 5.into())]),
                "`c.tar` is not one of the configured shards",
            ),
            (
                Dynamic::from("a.tar\u{1b}[2J"),
                "`a.tar\\u{1b}[2J` is not one",
            ),
            (
                map(&[("url", "a.tar".into()), ("stride", 0.into())]),
                "`stride` must be at least 1",
            ),
            (
                map(&[("url", "a.tar".into()), ("strid", 2.into())]),
                "unknown key `strid`",
            ),
            (
                map(&[("url", "a.tar".into()), ("start", "x".into())]),
                "`start` must be an integer",
            ),
        ];
        for (value, want) in bad {
            let err = dynamic_to_slice(value, &known).expect_err("bad shard");
            assert!(err.contains(want), "{err} lacks {want}");
        }
    }
}
