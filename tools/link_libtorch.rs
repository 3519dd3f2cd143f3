//! Build script shared by the crates whose binaries link libtorch (`imgrun`, `actors`).
//!
//! torch-sys (`links = "tch"`) tells its direct dependents where libtorch's libraries are
//! through `DEP_TCH_LIBTORCH_LIB`. We bake that folder into the binaries' rpath so they run
//! without `LD_LIBRARY_PATH`, and link with `--no-as-needed` so that `libtorch_cuda` stays a
//! dependency even though no symbol of it is referenced directly (otherwise CUDA silently
//! disappears from the binary).

pub fn main() {
    // This file, by an absolute path: the root package names it `tools/...` and `actors`
    // `../tools/...`, and a path that does not exist would rerun the script, and rebuild
    // and relink everything above it, on every build.
    let manifest =
        std::path::PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let script = ["tools/link_libtorch.rs", "../tools/link_libtorch.rs"]
        .iter()
        .map(|relative| manifest.join(relative))
        .find(|path| path.exists());
    if let Some(script) = script {
        println!("cargo:rerun-if-changed={}", script.display());
    }
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    if let Some(lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.to_string_lossy());
        let cuda = std::path::Path::new(&lib).join("libtorch_cuda.so");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        if cuda.exists() {
            println!("cargo:rustc-link-arg=-ltorch_cuda");
        }
        println!("cargo:rustc-link-arg=-ltorch_cpu");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
