//! Discovery through ROOTRANK_NIXL_DIR, an environment left untouched, and
//! idempotent loading. (One test in this binary: it sets process env vars.)

use std::path::Path;

use rootrank_transfer::{NixlLibrary, TransferAgent};

#[test]
fn env_dir_discovery_defaults_and_idempotent_load() {
    let cache = rootrank_testkit::nixl_dir().expect("NIXL for the tests");
    let empty = tempfile::tempdir().expect("tempdir");
    // An explicit dir is the only place looked at.
    assert!(NixlLibrary::load(Some(empty.path())).is_err());

    std::env::set_var("ROOTRANK_NIXL_DIR", &cache);
    std::env::remove_var("NIXL_PLUGIN_DIR");
    std::env::set_var("UCX_TLS", "tcp,self,sm");
    std::env::remove_var("UCX_MEM_EVENTS");
    let before: Vec<(std::ffi::OsString, std::ffi::OsString)> = std::env::vars_os().collect();
    let lib = NixlLibrary::load(None).expect("load via ROOTRANK_NIXL_DIR");
    assert!(lib.capi_path().ends_with(".nixl_cu12.mesonpy.libs/libnixl_capi.so"));
    assert!(lib.plugin_dir().join("libplugin_UCX.so").is_file());
    // Loading never changes the host's environment (setenv races getenv in a threaded host).
    let after: Vec<(std::ffi::OsString, std::ffi::OsString)> = std::env::vars_os().collect();
    assert_eq!(before, after, "NixlLibrary::load changed the environment");
    assert_eq!(
        rootrank_transfer::missing_ucx_defaults(),
        [("UCX_MEM_EVENTS", "no")],
        "what a parent would pass to a NIXL child"
    );

    // Loaded once: later calls return the same library, whatever they ask.
    let again = NixlLibrary::load(Some(Path::new("/nonexistent"))).expect("idempotent");
    assert_eq!(again.capi_path(), lib.capi_path());

    let t = std::time::Instant::now();
    // NIXL finds its UCX plugin next to libnixl.so without NIXL_PLUGIN_DIR.
    let agent = TransferAgent::new(&again, "discovery").expect("agent");
    eprintln!("agent + UCX backend in {:?}", t.elapsed());
    assert_eq!(agent.name(), "discovery");
    assert!(agent.local_metadata().expect("metadata").len() > 16);
    assert!(matches!(
        TransferAgent::new(&again, ""),
        Err(rootrank_transfer::TransferError::InvalidArgument(_))
    ));
}
