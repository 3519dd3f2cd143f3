//! The four shard hooks as sandboxed Rhai scripts: loading (built-in defaults embedded
//! from `scripts/`, or a user folder), the engine's limits, and one call per hook.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use rhai::{AST, Array, CallFnOptions, Dynamic, Engine, EvalAltResult, FuncArgs, Position, Scope};

use super::rng::SplitMix64;
use super::script_api::{
    HookContext, HookLimits, ScriptRng, dynamic_to_slice, sandboxed_engine, slice_to_dynamic,
};
use super::shards::Slice;

/// One of the four hooks, in the order they are called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HookName {
    Reseed,
    NodeSelection,
    ShardSelection,
    ShardShuffle,
}

impl HookName {
    pub const ALL: [HookName; 4] = [
        HookName::Reseed,
        HookName::NodeSelection,
        HookName::ShardSelection,
        HookName::ShardShuffle,
    ];

    /// The function name, which is also the file name without `.rhai`.
    pub fn name(self) -> &'static str {
        match self {
            HookName::Reseed => "reseed",
            HookName::NodeSelection => "node_selection",
            HookName::ShardSelection => "shard_selection",
            HookName::ShardShuffle => "shard_shuffle",
        }
    }

    fn params(self) -> &'static [&'static str] {
        match self {
            HookName::Reseed => &["ctx"],
            _ => &["shards", "ctx"],
        }
    }

    fn builtin_source(self) -> &'static str {
        match self {
            HookName::Reseed => include_str!("../../../scripts/reseed.rhai"),
            HookName::NodeSelection => include_str!("../../../scripts/node_selection.rhai"),
            HookName::ShardSelection => include_str!("../../../scripts/shard_selection.rhai"),
            HookName::ShardShuffle => include_str!("../../../scripts/shard_shuffle.rhai"),
        }
    }
}

impl fmt::Display for HookName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A hook script that cannot be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("cannot read hook script {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{file}: not a hook script (expected reseed, node_selection, shard_selection or shard_shuffle .rhai)"
    )]
    UnknownFile { file: String },
    #[error("{file}:{line}:{column}: hook `{hook}` does not compile: {message}")]
    Compile {
        hook: HookName,
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{file}: does not define `fn {hook}({params})`")]
    MissingFunction {
        hook: HookName,
        file: String,
        params: String,
    },
    #[error("hook `{hook}` failed at {file}:{line}:{column}: {message}")]
    Runtime {
        hook: HookName,
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("hook `{hook}` ({file}) went past its limit: {limit}")]
    Limit {
        hook: HookName,
        file: String,
        limit: String,
    },
    #[error("hook `{hook}` ({file}) returned {found}, expected an array of shards")]
    WrongReturnType {
        hook: HookName,
        file: String,
        found: String,
    },
    #[error("hook `{hook}` ({file}) returned a bad shard at index {index}: {problem}")]
    BadShard {
        hook: HookName,
        file: String,
        index: usize,
        problem: String,
    },
}

/// The text of the user's hook scripts, as read from their folder: what a job ships to
/// the machines that plan its epochs. Hooks the folder lacks are the built-in ones.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HookSources {
    user: Vec<HookSource>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct HookSource {
    /// The hook's name (`reseed`, ...).
    hook: String,
    /// Where it was read, for errors.
    file: String,
    source: String,
}

impl HookSources {
    /// Reads the hook scripts in `dir` (none: the built-in hooks). Any other `.rhai` file
    /// there is an error, so a misspelt hook never silently falls back to the default.
    pub fn read(dir: Option<&Path>) -> Result<Self, HookError> {
        let Some(dir) = dir else {
            return Ok(Self::default());
        };
        check_folder(dir)?;
        let mut user = Vec::new();
        for hook in HookName::ALL {
            let path = dir.join(format!("{}.rhai", hook.name()));
            if !path.is_file() {
                continue;
            }
            let source = std::fs::read_to_string(&path).map_err(|source| HookError::Read {
                path: path.clone(),
                source,
            })?;
            user.push(HookSource {
                hook: hook.name().to_string(),
                file: path.display().to_string(),
                source,
            });
        }
        Ok(Self { user })
    }

    /// The user's scripts in use, by file.
    pub fn files(&self) -> impl Iterator<Item = &str> {
        self.user.iter().map(|s| s.file.as_str())
    }
}

/// The loaded hooks: one compiled script per hook and the sandboxed engine that runs
/// them. Cheap to share between threads (`Send + Sync`).
pub struct Hooks {
    engine: Engine,
    scripts: Vec<Script>,
}

struct Script {
    hook: HookName,
    /// Shown in errors: the user's path, or `scripts/NAME.rhai (built-in)`.
    file: String,
    ast: AST,
}

impl fmt::Debug for Hooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.scripts.iter().map(|s| &s.file))
            .finish()
    }
}

impl Hooks {
    /// The built-in hooks: the scripts in the repository's `scripts/`, embedded at build
    /// time.
    pub fn builtin() -> Self {
        // The embedded scripts are compiled by the tests of this module; they cannot fail
        // to load under the default limits.
        Self::load(None, HookLimits::default()).expect("built-in hook scripts compile")
    }

    /// Hooks from `dir`, where each of `reseed.rhai`, `node_selection.rhai`,
    /// `shard_selection.rhai` and `shard_shuffle.rhai` that is present replaces the
    /// built-in one. Any other `.rhai` file there is an error (a misspelt hook must not
    /// silently fall back to the default).
    pub fn from_dir(dir: &Path) -> Result<Self, HookError> {
        Self::load(Some(dir), HookLimits::default())
    }

    /// Hooks from an optional folder, under the given limits.
    pub fn load(dir: Option<&Path>, limits: HookLimits) -> Result<Self, HookError> {
        Self::compile(&HookSources::read(dir)?, limits)
    }

    /// Hooks from sources read elsewhere (a trainer on another machine compiles the
    /// scripts its job's client read from the user's folder).
    pub fn compile(sources: &HookSources, limits: HookLimits) -> Result<Self, HookError> {
        let engine = sandboxed_engine(&limits);
        let mut scripts = Vec::with_capacity(HookName::ALL.len());
        for hook in HookName::ALL {
            let (file, source) = match sources.user.iter().find(|s| s.hook == hook.name()) {
                Some(user) => (user.file.clone(), user.source.as_str()),
                None => (
                    format!("scripts/{}.rhai (built-in)", hook.name()),
                    hook.builtin_source(),
                ),
            };
            scripts.push(compile(&engine, hook, file, source)?);
        }
        Ok(Self { engine, scripts })
    }

    /// Where each hook comes from, in call order.
    pub fn files(&self) -> impl Iterator<Item = (HookName, &str)> {
        self.scripts.iter().map(|s| (s.hook, s.file.as_str()))
    }

    /// Runs the four hooks for one (rank, worker, pass) and returns the worker's slices
    /// and its random generator as the hooks left it.
    pub(crate) fn run(
        &self,
        ctx: &HookContext,
        shards: &[Slice],
        known: &HashMap<String, Option<u64>>,
    ) -> Result<(Vec<Slice>, SplitMix64), HookError> {
        let rng = ScriptRng::new(ctx.rng_seed);
        let ctx_map = Dynamic::from_map(ctx.to_map(&rng));
        // `reseed` works through `ctx.rng`; what it returns does not matter.
        let _ = self.call(HookName::Reseed, (ctx_map.clone(),))?;
        let mut list: Array = shards.iter().map(slice_to_dynamic).collect();
        for hook in &HookName::ALL[1..] {
            let out = self.call(*hook, (list, ctx_map.clone()))?;
            let script = self.script(*hook);
            list = script.check_list(out, &self.engine)?;
            // Every hook's list is checked as it returns, so a bad element is blamed on
            // the hook that made it, not on the next one that trips over it.
            if *hook != HookName::ShardShuffle {
                script.slices(list.clone(), known)?;
            }
        }
        let slices = self.script(HookName::ShardShuffle).slices(list, known)?;
        Ok((slices, rng.snapshot()))
    }

    fn script(&self, hook: HookName) -> &Script {
        // `load` pushes one script per hook in `HookName::ALL` order.
        &self.scripts[hook as usize]
    }

    fn call(&self, hook: HookName, args: impl FuncArgs) -> Result<Dynamic, HookError> {
        let script = self.script(hook);
        let options = CallFnOptions::new().eval_ast(false).rewind_scope(true);
        self.engine
            .call_fn_with_options::<Dynamic>(
                options,
                &mut Scope::new(),
                &script.ast,
                hook.name(),
                args,
            )
            .map_err(|err| script.runtime_error(*err))
    }
}

fn check_folder(dir: &Path) -> Result<(), HookError> {
    let entries = std::fs::read_dir(dir).map_err(|source| HookError::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries {
        let path = entry
            .map_err(|source| HookError::Read {
                path: dir.to_path_buf(),
                source,
            })?
            .path();
        let is_script = path.extension().is_some_and(|e| e == "rhai");
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        if is_script && !HookName::ALL.iter().any(|h| h.name() == stem) {
            return Err(HookError::UnknownFile {
                file: path.display().to_string(),
            });
        }
    }
    Ok(())
}

fn compile(
    engine: &Engine,
    hook: HookName,
    file: String,
    source: &str,
) -> Result<Script, HookError> {
    let ast = engine.compile(source).map_err(|err| {
        let (line, column) = line_column(err.position());
        HookError::Compile {
            hook,
            file: file.clone(),
            line,
            column,
            message: err.err_type().to_string(),
        }
    })?;
    let params = hook.params();
    let defined = ast
        .iter_functions()
        .any(|f| f.name == hook.name() && f.params.len() == params.len());
    if !defined {
        return Err(HookError::MissingFunction {
            hook,
            file,
            params: params.join(", "),
        });
    }
    Ok(Script { hook, file, ast })
}

fn line_column(position: Position) -> (usize, usize) {
    (
        position.line().unwrap_or(0),
        position.position().unwrap_or(0),
    )
}

impl Script {
    fn runtime_error(&self, err: EvalAltResult) -> HookError {
        let mut err = innermost(err);
        let limit = match &err {
            EvalAltResult::ErrorTooManyOperations(..) => Some("too many operations".to_string()),
            EvalAltResult::ErrorTooManyVariables(..) => Some("too many variables".to_string()),
            EvalAltResult::ErrorStackOverflow(..) => Some("calls nested too deeply".to_string()),
            EvalAltResult::ErrorDataTooLarge(what, ..) => Some(format!("{what} too large")),
            _ => None,
        };
        if let Some(limit) = limit {
            return HookError::Limit {
                hook: self.hook,
                file: self.file.clone(),
                limit,
            };
        }
        let (line, column) = line_column(err.take_position());
        HookError::Runtime {
            hook: self.hook,
            file: self.file.clone(),
            line,
            column,
            message: err.to_string(),
        }
    }

    fn check_list(&self, value: Dynamic, engine: &Engine) -> Result<Array, HookError> {
        let found = engine.map_type_name(value.type_name()).to_string();
        value
            .try_cast::<Array>()
            .ok_or_else(|| HookError::WrongReturnType {
                hook: self.hook,
                file: self.file.clone(),
                found,
            })
    }

    /// The final list as slices: each element a `Shard`, a URL string, or a map with
    /// `url` and optionally `samples`, `start`, `stride`.
    fn slices(
        &self,
        list: Array,
        known: &HashMap<String, Option<u64>>,
    ) -> Result<Vec<Slice>, HookError> {
        list.into_iter()
            .enumerate()
            .map(|(index, value)| {
                dynamic_to_slice(value, known).map_err(|problem| HookError::BadShard {
                    hook: self.hook,
                    file: self.file.clone(),
                    index,
                    problem,
                })
            })
            .collect()
    }
}

/// The error inside any "error in function call" wrappers.
fn innermost(err: EvalAltResult) -> EvalAltResult {
    match err {
        EvalAltResult::ErrorInFunctionCall(_, _, inner, _) => innermost(*inner),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn builtin_hooks_compile_and_are_shareable() {
        assert_send_sync::<Hooks>();
        let hooks = Hooks::builtin();
        let files: Vec<_> = hooks.files().map(|(h, f)| (h, f.to_string())).collect();
        assert_eq!(files.len(), 4);
        assert_eq!(
            files[1],
            (
                HookName::NodeSelection,
                "scripts/node_selection.rhai (built-in)".into()
            )
        );
    }
}
