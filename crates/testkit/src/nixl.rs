//! The NIXL runtime for the tests that need it. They are never skipped: when it is missing it
//! is fetched, and when that fails the test fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{bail, Context};

/// The variable naming an unpacked NIXL wheel (as `rootrank_transfer::NIXL_DIR_ENV`).
pub const NIXL_DIR_ENV: &str = "ROOTRANK_NIXL_DIR";

/// The wheel's folder holding the C API, inside an unpacked `nixl-cu12` wheel.
const WHEEL_LIBS: &str = ".nixl_cu12.mesonpy.libs";
const CAPI: &str = "libnixl_capi.so";

/// Whether `dir` holds NIXL's C API: an unpacked wheel, or the libraries folder itself (the
/// two forms `NixlLibrary::load` accepts).
fn holds_nixl(dir: &Path) -> bool {
    dir.join(WHEEL_LIBS).join(CAPI).is_file() || dir.join(CAPI).is_file()
}

/// The NIXL runtime directory the tests use: `$ROOTRANK_NIXL_DIR` when it is set (it must
/// then hold NIXL: a wrong setting is an error, not a reason to fetch another copy), else
/// `<repo>/.cache/nixl`, unpacked by `scripts/fetch-nixl.sh` when it is not there yet.
///
/// Tests hand this directory on explicitly (to `NixlLibrary::load`, or as
/// `ROOTRANK_NIXL_DIR` to the processes they start), so every process loads the same copy.
/// Fetched at most once per test process.
pub fn nixl_dir() -> anyhow::Result<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| find_or_fetch().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn find_or_fetch() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os(NIXL_DIR_ENV).filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        if !holds_nixl(&dir) {
            bail!(
                "{NIXL_DIR_ENV}={} holds no {CAPI} (nor {WHEEL_LIBS}/{CAPI}): point it at an unpacked nixl-cu12 wheel, or unset it to use <repo>/.cache/nixl",
                dir.display()
            );
        }
        return Ok(dir);
    }
    let root = crate::repo_root();
    let dir = root.join(".cache/nixl");
    if holds_nixl(&dir) {
        return Ok(dir);
    }
    let script = root.join("scripts/fetch-nixl.sh");
    let status = Command::new("bash")
        .arg(&script)
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("{} failed: {status}", script.display());
    }
    if !holds_nixl(&dir) {
        bail!("{} did not unpack NIXL into {}", script.display(), dir.display());
    }
    Ok(dir)
}
