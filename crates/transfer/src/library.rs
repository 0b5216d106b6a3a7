//! Finding and loading the NIXL runtime (`libnixl_capi.so`) before any
//! nixl-sys call.
//!
//! nixl-sys is built with its `stub-api` feature: its C stubs
//! `dlopen("libnixl_capi.so")` once, on the first NIXL call, and *abort the
//! process* when that fails. So this module loads the library itself, by
//! absolute path, first. The dynamic loader then matches the stubs'
//! `dlopen("libnixl_capi.so")` to the already loaded object by its SONAME, and
//! `nixl_sys::is_stub()` (the only stub that never aborts) confirms it. Only
//! after that does any other nixl-sys call happen.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::error::TransferError;

/// Env var naming a directory with the unpacked NIXL wheel (or the libs dir).
pub const NIXL_DIR_ENV: &str = "ROOTRANK_NIXL_DIR";

/// The C API library the nixl-sys stubs forward to.
pub const CAPI_LIB: &str = "libnixl_capi.so";

/// Inside the unpacked nixl-cu12 wheel, the folder holding NIXL's own libs.
/// Its name is kept as in the wheel: the libraries' RPATHs point to it and to
/// `nixl_cu12.libs/` (UCX, abseil, ...).
pub const WHEEL_LIBS_DIR: &str = ".nixl_cu12.mesonpy.libs";

/// Where `scripts/fetch-nixl.sh` unpacks the wheel, relative to the repo root.
pub const CACHE_DIR: &str = ".cache/nixl";

/// The UCX settings rootrank's own processes run NIXL with, where the user has not set them
/// (applied by [`set_ucx_defaults_before_threads`] or passed to children; never by `load`).
pub const UCX_DEFAULTS: &[(&str, &str)] = &[
    // Shared-memory-only transports fail UCX backend creation here; tcp is
    // what makes cross-process wire-up work. self + sm keep local paths fast.
    ("UCX_TLS", "tcp,self,sm"),
    // Memory-event hooks cost ~0.4 s per agent start and are useless for
    // host memory registered up front.
    ("UCX_MEM_EVENTS", "no"),
];

struct Loaded {
    capi: PathBuf,
    libs_dir: PathBuf,
    plugin_dir: PathBuf,
    // Kept alive for the whole process: the nixl-sys stubs hold function
    // pointers into it. Never dropped (it lives in a static).
    _lib: libloading::Library,
}

static LOADED: OnceLock<Loaded> = OnceLock::new();
static LOAD_LOCK: Mutex<()> = Mutex::new(());

/// Proof that the real NIXL runtime is loaded in this process.
///
/// Cheap to clone; every [`crate::TransferAgent`] needs one, so no nixl-sys
/// call can happen before the library is in place.
#[derive(Clone, Copy)]
pub struct NixlLibrary {
    loaded: &'static Loaded,
}

impl std::fmt::Debug for NixlLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlLibrary")
            .field("capi", &self.loaded.capi)
            .field("plugin_dir", &self.loaded.plugin_dir)
            .finish()
    }
}

impl NixlLibrary {
    /// Finds and loads `libnixl_capi.so`.
    ///
    /// Discovery order, first hit wins:
    /// 1. `dir`, when given (and then only `dir`);
    /// 2. the directory in `ROOTRANK_NIXL_DIR`;
    /// 3. `<repo>/.cache/nixl`, for every ancestor of the current executable
    ///    and then of the current directory.
    ///
    /// Each candidate directory may be the unpacked wheel (holding
    /// `.nixl_cu12.mesonpy.libs/libnixl_capi.so`) or that libs folder itself.
    ///
    /// It never changes the environment: NIXL finds its `plugins/` folder next
    /// to `libnixl.so` by itself, and UCX's settings ([`UCX_DEFAULTS`]) are the
    /// host's to set (see [`set_ucx_defaults_before_threads`]).
    ///
    /// Idempotent: once loaded, later calls return the loaded library
    /// whatever `dir` says.
    pub fn load(dir: Option<&Path>) -> Result<NixlLibrary, TransferError> {
        if let Some(loaded) = LOADED.get() {
            if let Some(d) = dir.filter(|d| libs_dir_in(d).as_deref() != Some(loaded.libs_dir.as_path())) {
                tracing::warn!(
                    asked = %d.display(),
                    loaded = %loaded.capi.display(),
                    "NIXL is already loaded from elsewhere; keeping the loaded library"
                );
            }
            return Ok(NixlLibrary { loaded });
        }
        let _guard = LOAD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(loaded) = LOADED.get() {
            return Ok(NixlLibrary { loaded });
        }

        let candidates = candidate_dirs(dir);
        let Some(libs_dir) = candidates.iter().find_map(|c| libs_dir_in(c)) else {
            return Err(TransferError::LibraryMissing {
                wanted: format!("{CAPI_LIB} (or {WHEEL_LIBS_DIR}/{CAPI_LIB})"),
                searched: describe(&candidates, dir.is_some()),
            });
        };
        let capi = libs_dir.join(CAPI_LIB);
        let plugin_dir = libs_dir.join("plugins");
        if !plugin_dir.join("libplugin_UCX.so").is_file() {
            return Err(TransferError::LibraryInvalid {
                path: capi,
                detail: format!(
                    "the UCX backend plugin {} is missing",
                    plugin_dir.join("libplugin_UCX.so").display()
                ),
            });
        }

        // SAFETY: loading a shared library runs its initialisers. This is the
        // NIXL C API from the nixl-cu12 wheel, whose initialisers only set up
        // its own statics; its dependencies are found through its RPATH.
        let lib = unsafe { libloading::Library::new(&capi) }.map_err(|e| TransferError::LibraryInvalid {
            path: capi.clone(),
            detail: format!("the dynamic loader refused it: {}", error_chain(&e)),
        })?;

        // The stubs now dlopen("libnixl_capi.so") and get the object loaded
        // above (matched by SONAME). is_stub() is the one stub that does not
        // abort when that fails.
        if nixl_sys::is_stub() {
            return Err(TransferError::LibraryInvalid {
                path: capi,
                detail: "it loaded, but nixl-sys could not bind to it (is its SONAME \
                         libnixl_capi.so? was a NIXL call made before NixlLibrary::load?)"
                    .to_string(),
            });
        }

        tracing::debug!(capi = %capi.display(), "NIXL runtime loaded");
        let loaded = LOADED.get_or_init(|| Loaded {
            capi,
            libs_dir,
            plugin_dir,
            _lib: lib,
        });
        Ok(NixlLibrary { loaded })
    }

    /// The loaded `libnixl_capi.so`.
    pub fn capi_path(&self) -> &Path {
        &self.loaded.capi
    }

    /// The folder holding NIXL's libraries.
    pub fn libs_dir(&self) -> &Path {
        &self.loaded.libs_dir
    }

    /// The NIXL backend plugin folder (holds `libplugin_UCX.so`).
    pub fn plugin_dir(&self) -> &Path {
        &self.loaded.plugin_dir
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// Sets each of [`UCX_DEFAULTS`] that is not set yet, in this process's environment.
///
/// The library itself never changes the environment: in a process with threads, `setenv`
/// races every `getenv` (glibc's environment is not thread-safe), and rootrank runs inside
/// other people's processes. A program that owns its process (rootrank's own binaries) calls
/// this first thing in `main`; a process that spawns NIXL users passes [`UCX_DEFAULTS`] to
/// them with `Command::envs`; an embedder sets the variables itself before it starts.
///
/// # Safety
/// No other thread may exist yet (or read or write the environment meanwhile).
pub unsafe fn set_ucx_defaults_before_threads() {
    for (k, v) in UCX_DEFAULTS {
        if std::env::var_os(k).is_none() {
            std::env::set_var(k, v);
        }
    }
}

/// The [`UCX_DEFAULTS`] not set in this process's environment: what a parent passes to a
/// child that uses NIXL (`Command::envs`), leaving its own environment alone.
pub fn missing_ucx_defaults() -> Vec<(&'static str, &'static str)> {
    UCX_DEFAULTS
        .iter()
        .filter(|(k, _)| std::env::var_os(k).is_none())
        .copied()
        .collect()
}

fn candidate_dirs(explicit: Option<&Path>) -> Vec<PathBuf> {
    if let Some(dir) = explicit {
        return vec![dir.to_path_buf()];
    }
    let mut out = Vec::new();
    if let Some(env_dir) = std::env::var_os(NIXL_DIR_ENV).filter(|v| !v.is_empty()) {
        out.push(PathBuf::from(env_dir));
    }
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(parent) = exe.parent() {
            roots.push(parent.to_path_buf());
        }
    }
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd);
    }
    for root in roots {
        for ancestor in root.ancestors() {
            let c = ancestor.join(CACHE_DIR);
            if !out.contains(&c) {
                out.push(c);
            }
        }
    }
    out
}

/// The folder holding `libnixl_capi.so` for a candidate directory, if any.
fn libs_dir_in(dir: &Path) -> Option<PathBuf> {
    [dir.join(WHEEL_LIBS_DIR), dir.to_path_buf()]
        .into_iter()
        .find(|d| d.join(CAPI_LIB).is_file())
        .map(|d| std::fs::canonicalize(&d).unwrap_or(d))
}

fn describe(candidates: &[PathBuf], explicit: bool) -> String {
    let list: Vec<OsString> = candidates.iter().map(|p| p.as_os_str().to_os_string()).collect();
    let joined = list
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(", ");
    if explicit {
        format!("the given directory [{joined}]")
    } else {
        format!("[{joined}] (explicit dir, then ${NIXL_DIR_ENV}, then <ancestor>/{CACHE_DIR})")
    }
}
