//! Discovery through ROOTRANK_NIXL_DIR, the env defaults, and idempotent
//! loading. (One test in this binary: it sets process env vars.)

use std::path::Path;

use rootrank_transfer::{NixlLibrary, TransferAgent};

#[test]
fn env_dir_discovery_defaults_and_idempotent_load() {
    let cache = rootrank_testkit::nixl_dir().expect("NIXL for the tests");
    let empty = tempfile::tempdir().expect("tempdir");
    // An explicit dir is the only place looked at.
    assert!(NixlLibrary::load(Some(empty.path())).is_err());

    std::env::set_var("ROOTRANK_NIXL_DIR", &cache);
    std::env::remove_var("UCX_TLS");
    std::env::set_var("UCX_MEM_EVENTS", "no"); // a user value is kept as is
    let lib = NixlLibrary::load(None).expect("load via ROOTRANK_NIXL_DIR");
    assert!(lib.capi_path().ends_with(".nixl_cu12.mesonpy.libs/libnixl_capi.so"));
    assert!(lib.plugin_dir().join("libplugin_UCX.so").is_file());
    assert_eq!(std::env::var("UCX_TLS").as_deref(), Ok("tcp,self,sm"));
    assert_eq!(
        std::env::var_os("NIXL_PLUGIN_DIR").as_deref(),
        Some(lib.plugin_dir().as_os_str())
    );

    // Loaded once: later calls return the same library, whatever they ask.
    let again = NixlLibrary::load(Some(Path::new("/nonexistent"))).expect("idempotent");
    assert_eq!(again.capi_path(), lib.capi_path());

    let t = std::time::Instant::now();
    let agent = TransferAgent::new(&again, "discovery").expect("agent");
    eprintln!("agent + UCX backend in {:?}", t.elapsed());
    assert_eq!(agent.name(), "discovery");
    assert!(agent.local_metadata().expect("metadata").len() > 16);
    assert!(matches!(
        TransferAgent::new(&again, ""),
        Err(rootrank_transfer::TransferError::InvalidArgument(_))
    ));
}
