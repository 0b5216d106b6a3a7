//! A memory cgroup of a test's own, for real OOM kills. Needs root.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rootrank_watchdog::cgroup::parse_mountinfo;

/// A memory cgroup with a hard limit and no swap, on whichever hierarchy has the memory
/// controller (cgroup v1 `memory`, else the unified one). Removed when dropped, once the
/// processes in it are gone.
pub struct MemoryCgroup {
    dir: PathBuf,
}

impl MemoryCgroup {
    /// Creates `rootrank-<name>-<our pid>` limited to `limit_bytes`.
    pub fn create(name: &str, limit_bytes: u64) -> io::Result<MemoryCgroup> {
        let mounts = parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo")?);
        let leaf = format!("rootrank-{name}-{}", std::process::id());
        if let Some((mnt, _)) = mounts.memory_v1 {
            let cg = MemoryCgroup::make(mnt.join(leaf))?;
            std::fs::write(cg.dir.join("memory.limit_in_bytes"), limit_bytes.to_string())?;
            return Ok(cg);
        }
        if let Some((mnt, _)) = mounts.unified {
            let cg = MemoryCgroup::make(mnt.join(leaf))?;
            std::fs::write(cg.dir.join("memory.max"), limit_bytes.to_string())?;
            // No swap, so the limit is reached instead of swapping (absent without swap).
            let _ = std::fs::write(cg.dir.join("memory.swap.max"), "0");
            return Ok(cg);
        }
        Err(io::Error::other("no memory cgroup hierarchy mounted"))
    }

    fn make(dir: PathBuf) -> io::Result<MemoryCgroup> {
        std::fs::create_dir(&dir)?;
        Ok(MemoryCgroup { dir })
    }

    /// The cgroup's directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Moves process `pid` into the cgroup.
    pub fn add(&self, pid: u32) -> io::Result<()> {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // A cgroup can be removed only once its last process is gone (and reaped).
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
