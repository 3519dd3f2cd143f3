//! Builds the libjpeg-turbo region decoder (`csrc/jpeg_region.c`) when the C compiler
//! finds libjpeg-turbo's headers (Debian: `libjpeg62-turbo-dev`), linking the static
//! library when there is one, so binaries do not need libjpeg at run time. Without
//! them, or with `IMGRUN_NO_LIBJPEG` set, the transforms decode every JPEG with
//! zune-jpeg alone (slower on crops) and the build says so once.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(imgrun_libjpeg)");
    println!("cargo::rerun-if-changed=csrc/jpeg_region.c");
    println!("cargo::rerun-if-env-changed=IMGRUN_NO_LIBJPEG");
    if std::env::var_os("IMGRUN_NO_LIBJPEG").is_some() {
        return;
    }
    let mut build = cc::Build::new();
    build
        .file("csrc/jpeg_region.c")
        .opt_level(2)
        .warnings(true)
        .flag_if_supported("-Werror=implicit-function-declaration");
    if let Err(error) = build.try_compile("imgrun_jpeg_region") {
        println!(
            "cargo::warning=libjpeg-turbo headers not found ({error}); JPEG crops decode \
             with zune-jpeg alone (install libjpeg62-turbo-dev for the faster path)"
        );
        return;
    }
    match static_library(&build) {
        Some(dir) => {
            println!("cargo::rustc-link-search=native={}", dir.display());
            println!("cargo::rustc-link-lib=static=jpeg");
        }
        None => println!("cargo::rustc-link-lib=jpeg"),
    }
    println!("cargo::rustc-cfg=imgrun_libjpeg");
}

/// The folder of `libjpeg.a` as the C compiler finds it, if it does.
fn static_library(build: &cc::Build) -> Option<std::path::PathBuf> {
    let compiler = build.try_get_compiler().ok()?;
    let output = compiler
        .to_command()
        .arg("-print-file-name=libjpeg.a")
        .output()
        .ok()?;
    let path = std::path::PathBuf::from(String::from_utf8(output.stdout).ok()?.trim());
    // A compiler that does not find the file prints its bare name.
    if path.is_absolute() && path.is_file() {
        path.parent().map(std::path::Path::to_path_buf)
    } else {
        None
    }
}
