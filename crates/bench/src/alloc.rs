//! A counting global allocator, installed by the `rootrank-bench` binary, to measure the core
//! index's own bytes per record (separately from the coordinator's allocator and HTTP overhead).
//! Counting is off unless a measurement turns it on, so other figures (e.g. the cost of
//! `record_failure`) do not pay for shared atomic counters.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

pub struct Counting;

static ENABLED: AtomicBool = AtomicBool::new(false);

std::thread_local! {
    // Only the measuring thread counts: runtime threads freeing their own older blocks at the
    // same time would otherwise blur the figure. Const-initialized, so reading it never
    // allocates (which an allocator must not do).
    static HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn counting() -> bool {
    ENABLED.load(Ordering::Relaxed) && HERE.try_with(|h| h.get()).unwrap_or(false)
}
static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() && counting() {
            add(layout.size() as i64);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if counting() {
            LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        }
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() && counting() {
            LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
            add(new_size as i64);
        }
        p
    }
}

fn add(n: i64) {
    let live = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(live, Ordering::Relaxed);
    ALLOCS.fetch_add(1, Ordering::Relaxed);
}

/// Counted (live bytes, peak live bytes, allocations) since [`start`].
#[derive(Clone, Copy, Debug)]
pub struct Counts {
    pub live: i64,
    pub peak: i64,
    pub allocs: u64,
}

/// Starts counting from zero, on the calling thread only. Blocks freed later that were
/// allocated before `start` make `live` a little low; measurements allocate what they measure
/// after `start`.
pub fn start() {
    HERE.with(|h| h.set(true));
    LIVE.store(0, Ordering::SeqCst);
    PEAK.store(0, Ordering::SeqCst);
    ALLOCS.store(0, Ordering::SeqCst);
    ENABLED.store(true, Ordering::SeqCst);
}

pub fn read() -> Counts {
    Counts {
        live: LIVE.load(Ordering::SeqCst),
        peak: PEAK.load(Ordering::SeqCst),
        allocs: ALLOCS.load(Ordering::SeqCst),
    }
}

pub fn stop() -> Counts {
    let c = read();
    ENABLED.store(false, Ordering::SeqCst);
    HERE.with(|h| h.set(false));
    c
}

/// Whether the running binary installed [`Counting`] (an allocation is seen while enabled).
pub fn installed() -> bool {
    start();
    let v = std::hint::black_box(vec![0u8; 64]);
    drop(v);
    stop().allocs > 0
}
