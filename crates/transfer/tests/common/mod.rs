//! Shared by the peer_* and write_roundtrip tests (each uses all of it): real NIXL, real peer
//! processes (the `transfer-peer` bin), and a checkable byte pattern.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rootrank_testkit::nixl::NIXL_DIR_ENV;
use rootrank_testkit::{nixl_dir, repo_root, signal};
use rootrank_transfer::{NixlLibrary, RegionId, RemoteRegion, TransferAgent};

pub const PEER_BIN: &str = env!("CARGO_BIN_EXE_transfer-peer");

/// The tests' NIXL ([`nixl_dir`]: `ROOTRANK_NIXL_DIR`, else `<repo>/.cache/nixl`, fetched when
/// missing). Panics (fails the test) when it does not load: these tests are never skipped.
pub fn load() -> NixlLibrary {
    let dir = nixl_dir().expect("NIXL for the tests");
    match NixlLibrary::load(Some(&dir)) {
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
        let nixl = nixl_dir().expect("NIXL for the tests");
        let child = Command::new(PEER_BIN)
            .args([
                "receive",
                dir.to_str().expect("utf-8 tempdir"),
                name,
                &region_len.to_string(),
                "60",
            ])
            .current_dir(repo_root())
            .env(NIXL_DIR_ENV, nixl)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn transfer-peer");
        Peer {
            child,
            dir: dir.to_path_buf(),
            name: name.to_string(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
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
            signal(self.pid(), libc::SIGCONT);
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

/// Fills a whole local region with the pattern of `seed` (through a copy: the agent hands
/// out no slices over memory peers write into).
pub fn fill_region(agent: &mut TransferAgent, region: RegionId, seed: u64) {
    let mut bytes = vec![0u8; agent.region_len(region).expect("region")];
    fill_pattern(&mut bytes, seed);
    agent.write_region(region, 0, &bytes).expect("fill the region");
}

/// A deterministic, non-repeating-looking byte pattern.
fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 24) as u8;
    }
}
