//! The actors crate's build script: libtorch's link flags (the part it shares with the
//! binary, `tools/link_libtorch.rs`), and the C++ shim of what tch does not bind: the
//! gradient-ready hooks of the overlapped allreduce (`csrc/grad_hooks.cpp`) and the CUDA
//! autocast dtype (`csrc/autocast.cpp`), compiled against libtorch's own headers (the
//! `include` folder beside the libraries torch-sys links).

#[path = "../tools/link_libtorch.rs"]
mod link_libtorch;

use std::path::PathBuf;

fn main() {
    link_libtorch::main();
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc/grad_hooks.cpp");
    println!("cargo:rerun-if-changed=csrc/autocast.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let Some(lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB)");
    };
    let include = PathBuf::from(lib)
        .parent()
        .map(|root| root.join("include"))
        .filter(|include| include.join("torch/csrc/autograd/variable.h").exists());
    let Some(include) = include else {
        panic!(
            "libtorch's headers (include/torch/csrc/autograd/variable.h) are not beside its lib folder"
        );
    };
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .file("csrc/grad_hooks.cpp")
        .file("csrc/autocast.cpp");
    // torch-sys's variable for libtorchs built with the old C++ ABI.
    if let Ok(abi) = std::env::var("LIBTORCH_CXX11_ABI") {
        build.define("_GLIBCXX_USE_CXX11_ABI", abi.as_str());
    }
    build.compile("imgrun_shim");
}
