//! Shared helpers: real NIXL, real peer processes (the `transfer-peer` bin).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use rootrank_transfer::{NixlLibrary, RemoteRegion, TransferAgent};

pub const PEER_BIN: &str = env!("CARGO_BIN_EXE_transfer-peer");

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Makes sure `<repo>/.cache/nixl` holds NIXL, running `scripts/fetch-nixl.sh`
/// when it does not. Panics (fails the test) when that does not work: these
/// tests are never skipped.
pub fn ensure_nixl() {
    static FETCH: Once = Once::new();
    FETCH.call_once(|| {
        let root = repo_root();
        let capi = root.join(".cache/nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so");
        if std::env::var_os("ROOTRANK_NIXL_DIR").is_some() || capi.is_file() {
            return;
        }
        let status = Command::new("bash")
            .arg(root.join("scripts/fetch-nixl.sh"))
            .status()
            .expect("run scripts/fetch-nixl.sh");
        assert!(status.success(), "scripts/fetch-nixl.sh failed: {status}");
        assert!(capi.is_file(), "fetch-nixl.sh did not produce {}", capi.display());
    });
}

pub fn load() -> NixlLibrary {
    ensure_nixl();
    match NixlLibrary::load(None) {
        Ok(lib) => lib,
        Err(e) => panic!("NIXL must load for these tests: {e}"),
    }
}

/// A receiving peer process and where it publishes.
pub struct Peer {
    pub child: Child,
    pub dir: PathBuf,
    pub name: String,
}

impl Peer {
    pub fn spawn(dir: &Path, name: &str, region_len: usize) -> Peer {
        ensure_nixl();
        let child = Command::new(PEER_BIN)
            .args([
                "receive",
                dir.to_str().expect("utf-8 tempdir"),
                name,
                &region_len.to_string(),
                "60",
            ])
            .current_dir(repo_root())
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn transfer-peer");
        Peer {
            child,
            dir: dir.to_path_buf(),
            name: name.to_string(),
        }
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid fits i32")
    }

    /// Waits for the peer's metadata and region descriptor files.
    pub fn published(&mut self) -> (Vec<u8>, RemoteRegion) {
        let md_path = self.dir.join(format!("{}.md", self.name));
        let region_path = self.dir.join(format!("{}.region.json", self.name));
        let deadline = Instant::now() + Duration::from_secs(30);
        // The region file is renamed into place first, the metadata last.
        while !md_path.is_file() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("peer {} exited early: {status}", self.name);
            }
            assert!(Instant::now() < deadline, "peer {} never published", self.name);
            std::thread::sleep(Duration::from_millis(10));
        }
        let region: RemoteRegion =
            serde_json::from_slice(&std::fs::read(&region_path).expect("read region")).expect("parse region");
        (std::fs::read(&md_path).expect("read metadata"), region)
    }

    /// Waits for the peer's metadata and region, loads it into `agent`.
    pub fn connect(&mut self, agent: &mut TransferAgent) -> (String, RemoteRegion) {
        let (md, region) = self.published();
        let name = agent.load_peer(&md).expect("load peer metadata");
        assert_eq!(name, self.name);
        (name, region)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join(format!("{}.log", self.name))).unwrap_or_default()
    }

    /// Waits until the peer's log has a line containing `needle`.
    pub fn wait_log(&self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let log = self.log();
            if let Some(line) = log.lines().find(|l| l.contains(needle)) {
                return line.to_string();
            }
            assert!(
                Instant::now() < deadline,
                "peer {} never logged {needle:?}; log so far:\n{log}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({}, {sig})", self.pid());
    }

    /// Waits for the peer to exit, killing it after `within`.
    pub fn finish(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                return self.child.wait().expect("wait");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SIGCONT a possibly stopped child first, then kill and reap it,
            // so no peer outlives a failed test.
            // SAFETY: kill(2) on our own, not yet reaped, child's pid.
            unsafe { libc::kill(self.pid(), libc::SIGCONT) };
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A deterministic, non-repeating-looking byte pattern.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 24) as u8;
    }
}
