//! A rank's transfer agent: the NIXL transfer path (rootrank-transfer) with the rootrank
//! agent built in ([`RankAgent`]). It publishes its NIXL metadata on the rank's liveness
//! lease, loads peers' metadata from etcd (and reloads it when a peer restarts), and turns
//! every transfer error into a first-hand (`local`) room failure record naming the peer.
//!
//! The simulated deployment that runs ranks built on it is another crate (`rootrank-sim`).

pub mod error;
pub mod hex;
pub mod transfer_agent;

pub use error::{RoomTransferError, TransferAgentError};
pub use transfer_agent::{NixlRecord, PeerRef, RankAgent, NIXL_SUFFIX};

pub use rootrank_transfer::{set_ucx_defaults_before_threads, NixlLibrary, TransferError, NIXL_DIR_ENV};

/// Loads NIXL for a rootrank process. When a directory is named (`dir`, else a non-empty
/// `ROOTRANK_NIXL_DIR`) only that directory is searched: an operator who names a directory
/// means it, and a silent fallback to some `.cache/nixl` would hide the mistake. With neither,
/// the transfer crate's discovery applies (`<ancestor>/.cache/nixl` of the binary and cwd).
pub fn load_nixl(dir: Option<&std::path::Path>) -> Result<NixlLibrary, TransferError> {
    let from_env = std::env::var_os(NIXL_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from);
    NixlLibrary::load(dir.or(from_env.as_deref()))
}

/// 64 random bits from the kernel (getrandom(2)); falls back to a time-and-pid hash if the
/// call fails, which only weakens uniqueness, never correctness.
pub fn random_u64() -> u64 {
    let mut buf = [0u8; 8];
    // SAFETY: getrandom writes at most buf.len() bytes into buf, which we own.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n == 8 {
        return u64::from_ne_bytes(buf);
    }
    // std's RandomState is seeded from the OS once per process and per instance.
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now())
}

/// A bootstrap_room as SGLang's Rust gateway mints it: `rand::random::<u64>() & i64::MAX`.
pub fn random_room() -> u64 {
    random_u64() & (i64::MAX as u64)
}

/// A random UUID (v4) string: SGLang names each NIXL agent with one per process.
pub fn random_uuid() -> String {
    let (a, b) = (random_u64(), random_u64());
    let a = (a & !0xf000) | 0x4000; // version 4
    let b = (b & !(0b11 << 62)) | (0b10 << 62); // RFC 4122 variant
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_fit_63_bits_and_uuids_look_like_uuids() {
        for _ in 0..100 {
            assert!(random_room() <= i64::MAX as u64);
        }
        let u = random_uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(u.as_bytes()[14], b'4');
        assert_ne!(random_uuid(), u);
    }
}
