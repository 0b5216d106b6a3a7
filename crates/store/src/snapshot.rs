//! Everything under a prefix at one revision, read in parallel parts.
//!
//! Why not one range with a limit, page after page, as etcd's docs suggest: etcd 3.4 walks
//! its in-memory index over the *whole* requested range on every request, whatever the limit
//! (it collects every revision, then counts them), 150-360 ns per key here. Paging a million
//! keys 5,000 at a time from the prefix to its end walks ~100 million index entries: 27-60 s
//! of etcd CPU measured here, for a few seconds of reading. So every request here asks for a
//! short range: from the reader's position to the end of one of that position's ancestor
//! prefixes (`…/groups/scale-10` ends where `…/groups/scale-11` begins), an ancestor chosen
//! from the counts etcd returns so that a range holds about a page. Keys are structured
//! (group, `rooms/`, a decimal room, `ranks/`, a rank), so ancestors split them well.
//!
//! Several readers run at once, all at one revision: the first request (linearizable) fixes
//! it, the others are serializable reads at it, served by whichever member answers with no
//! raft round (a member that has not applied it yet says so, and the request is retried).
//! A reader that runs out of work takes over the far part of the busiest reader's range, cut
//! at that reader's coarsest unfinished ancestor (for `…/groups/scale-1…` that is everything
//! from `…/groups/scale-2` on): group prefixes become parts without a list of groups. Pages
//! are handed over as they arrive, in no particular key order; the index does not need one.
//!
//! [`Plan`] decides every range and holds no I/O, so its rules are unit-tested;
//! [`snapshot_pages`] is the shell that sends the requests.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{Client, GetOptions, KeyValue};
use rootrank_core::Event;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;

use crate::{prefix_end, Backoff};

/// Keys per request: a page of records (~300 bytes each) stays well under gRPC's 4 MiB
/// message limit, and is big enough that the cost per request is small.
pub const PAGE: i64 = 5_000;

/// Readers by default: enough to keep a few etcd cores busy while the caller applies pages.
pub const DEFAULT_READERS: usize = 4;

/// What a snapshot read took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotStats {
    /// The revision every key was read at.
    pub revision: i64,
    pub keys: u64,
    pub requests: u64,
    /// Index entries etcd walked to answer (the sum of its counts): the cost that grows with
    /// the square of the keys when ranges are not bounded.
    pub walked: u64,
    /// Readers run (the number asked for, within 1..=64).
    pub readers: u64,
    /// Readers that got a part to read.
    pub busy_readers: u64,
}

/// Reads everything under `prefix` at one revision with `readers` concurrent readers
/// (sharing `client`'s connection), handing each page to `page` as it arrives (in no particular
/// order), so the caller can apply and drop it: at most two pages per reader are in memory (one
/// waiting, one being read).
pub async fn snapshot_pages(
    client: &Client,
    prefix: &str,
    observed_at_ms: i64,
    readers: usize,
    page: impl FnMut(Vec<Event>),
) -> Result<SnapshotStats, etcd_client::Error> {
    snapshot_pages_skipping(client, prefix, None, observed_at_ms, readers, page).await
}

/// [`snapshot_pages`] without the keys under `skip` (a part of `prefix` the reader has no
/// use for: the coordinator and rank hosts' copies of live records).
pub async fn snapshot_pages_skipping(
    client: &Client,
    prefix: &str,
    skip: Option<&str>,
    observed_at_ms: i64,
    readers: usize,
    mut page: impl FnMut(Vec<Event>),
) -> Result<SnapshotStats, etcd_client::Error> {
    let readers = readers.clamp(1, 64);
    let revision = current_revision(client, prefix).await?;
    let mut plan = Plan::new(prefix.as_bytes(), readers, PAGE);
    if let Some(skip) = skip {
        plan = plan.skipping(skip.as_bytes());
    }
    let plan = Arc::new(Mutex::new(plan));
    let progress = Arc::new(Notify::new());
    let (tx, mut rx) = mpsc::channel(readers);
    let mut tasks = JoinSet::new();
    for reader in 0..readers {
        tasks.spawn(read_ranges(
            client.clone(),
            plan.clone(),
            progress.clone(),
            reader,
            revision,
            observed_at_ms,
            tx.clone(),
        ));
    }
    drop(tx);
    // Ends when every reader is done (all senders dropped), or at the first error or the
    // first reader that stopped abnormally: returning drops `tasks`, which aborts the others
    // (and readers waiting for a part that reader held would otherwise wait for ever).
    let mut keys = 0u64;
    loop {
        tokio::select! {
            next = rx.recv() => match next {
                Some(next) => {
                    let next = next?;
                    keys += next.len() as u64;
                    page(next);
                }
                None => break,
            },
            Some(Err(e)) = tasks.join_next() => {
                return Err(etcd_client::Error::IoError(std::io::Error::other(format!(
                    "a snapshot reader stopped: {e}"
                ))));
            }
        }
    }
    let plan = plan.lock().unwrap_or_else(PoisonError::into_inner);
    Ok(SnapshotStats {
        revision,
        keys,
        requests: plan.requests,
        walked: plan.walked,
        readers: readers as u64,
        busy_readers: plan.busy.iter().filter(|b| **b).count() as u64,
    })
}

/// A key-value etcd returned, as the index takes it: a put seen at `observed_at_ms`.
pub fn put_event(kv: KeyValue, observed_at_ms: i64) -> Event {
    let lease = kv.lease();
    let revision = kv.mod_revision();
    let create_revision = kv.create_revision();
    let (key, value) = kv.into_key_value();
    Event::Put {
        key,
        value,
        lease,
        revision,
        create_revision,
        observed_at_ms,
    }
}

/// etcd's current revision, from a one-key read (cheap: no range to walk).
async fn current_revision(client: &Client, prefix: &str) -> Result<i64, etcd_client::Error> {
    let resp = with_retries(client, prefix.as_bytes(), GetOptions::new().with_count_only()).await?;
    Ok(resp.header().map_or(0, |h| h.revision()))
}

async fn read_ranges(
    client: Client,
    plan: Arc<Mutex<Plan>>,
    progress: Arc<Notify>,
    reader: usize,
    revision: i64,
    observed_at_ms: i64,
    tx: mpsc::Sender<Result<Vec<Event>, etcd_client::Error>>,
) {
    loop {
        // Registered before the plan is asked, so a wake-up in between is not lost.
        let answered = progress.notified();
        let next = plan.lock().unwrap_or_else(PoisonError::into_inner).next(reader);
        let (start, end) = match next {
            Next::Read { start, end } => (start, end),
            Next::Wait => {
                answered.await;
                continue;
            }
            Next::Done => {
                progress.notify_waiters();
                return;
            }
        };
        let opts = GetOptions::new()
            .with_range(end)
            .with_limit(PAGE)
            .with_revision(revision)
            .with_serializable();
        let mut resp = match with_retries(&client, &start, opts).await {
            Ok(r) => r,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
        };
        let (count, more) = (resp.count(), resp.more());
        let kvs = resp.take_kvs();
        plan.lock().unwrap_or_else(PoisonError::into_inner).answered(
            reader,
            count,
            more,
            kvs.last().map(|kv| kv.key()),
        );
        progress.notify_waiters();
        if kvs.is_empty() {
            continue;
        }
        let events = kvs.into_iter().map(|kv| put_event(kv, observed_at_ms)).collect();
        if tx.send(Ok(events)).await.is_err() {
            return; // the caller gave up
        }
    }
}

/// One request, retried at the same revision: an etcd busy renewing thousands of leases can
/// time a request out, and starting the whole snapshot over would never finish.
async fn with_retries(
    client: &Client,
    start: &[u8],
    opts: GetOptions,
) -> Result<etcd_client::GetResponse, etcd_client::Error> {
    let mut client = client.clone();
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut attempt = 0;
    loop {
        match client.get(start.to_vec(), Some(opts.clone())).await {
            Ok(r) => return Ok(r),
            // A compacted revision cannot be read again: the caller starts a new snapshot.
            Err(e) if attempt >= 20 || crate::is_compacted(&e) => return Err(e),
            Err(e) => {
                attempt += 1;
                tracing::debug!(error = %e, attempt, "snapshot request failed; retrying at the same revision");
                tokio::time::sleep(backoff.next_pause()).await;
            }
        }
    }
}

/// What a reader does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Ask etcd for the keys in `[start, end)`.
    Read { start: Vec<u8>, end: Vec<u8> },
    /// Nothing to do until another reader's request comes back (its part may then be cut).
    Wait,
    /// Every key is read or being read by someone else.
    Done,
}

/// Which range each reader asks for next. Pure: the readers report etcd's answers, and the
/// plan moves their positions, sizes their ranges and hands work to idle readers.
///
/// A request's range runs from the reader's position to the end of an ancestor of it, the
/// ancestor's length adapted to etcd's counts: one byte longer after a range of more than
/// two pages (and never that short again nearby: siblings are alike), one shorter after a
/// range of under half a page. After an empty range the position is a boundary, not a key
/// (`…/scale-10:` after `…/scale-109` was read): the next range is the rest of its parent
/// (`…/scale-10:` to `…/scale-11`), and after that the new position's own subtree
/// (`…/scale-11` to `…/scale-12`), so boundaries cost a couple of cheap requests and no
/// walk of the keys beyond.
#[derive(Debug)]
pub struct Plan {
    page: i64,
    parts: Vec<Part>,
    /// A range no request reaches into (`[start, end)` of a prefix), see [`Plan::skipping`].
    skip: Option<(Vec<u8>, Vec<u8>)>,
    requests: u64,
    walked: u64,
    busy: Vec<bool>,
}

/// One reader's share: keys in `[start, end)` are still to be read.
#[derive(Debug, Clone)]
struct Part {
    start: Vec<u8>,
    end: Vec<u8>,
    /// The length of the ancestor of `start` whose end bounds the next request.
    depth: usize,
    /// The shortest ancestor length not found too wide nearby: no widening past it.
    floor: usize,
    /// The ancestor length for the next request only (after an empty range).
    once: Option<usize>,
    /// Whether a range of about a page was seen: sizes nearby are known.
    fitted: bool,
    /// The count of the last range found too wide, to tell a level that splits from one
    /// that does not.
    last_wide: Option<i64>,
    /// The end of the request in flight, if any: a cut never falls before it.
    in_flight: Option<Vec<u8>>,
}

impl Part {
    fn new(start: Vec<u8>, end: Vec<u8>, depth: usize, floor: usize) -> Part {
        Part {
            start,
            end,
            depth,
            floor,
            once: None,
            fitted: false,
            last_wide: None,
            in_flight: None,
        }
    }

    fn is_empty(&self) -> bool {
        self.start >= self.end
    }
}

impl Plan {
    /// Reader 0 starts with the whole prefix; the others take parts of it as it is read.
    pub fn new(prefix: &[u8], readers: usize, page: i64) -> Plan {
        let mut parts = vec![Part::new(Vec::new(), Vec::new(), 0, 0); readers.max(1)];
        parts[0] = Part::new(prefix.to_vec(), prefix_end(prefix), prefix.len(), 0);
        Plan {
            page,
            parts,
            skip: None,
            requests: 0,
            walked: 0,
            busy: vec![false; readers.max(1)],
        }
    }

    /// Reads nothing under `prefix`: requests end where it starts and resume where it ends
    /// (thousands of tiny sibling prefixes, such as hosts' copies, would otherwise cost a
    /// request each few of them).
    pub fn skipping(mut self, prefix: &[u8]) -> Plan {
        self.skip = Some((prefix.to_vec(), prefix_end(prefix)));
        self
    }

    /// A part whose position is inside the skipped range moves past it.
    fn jump_skip(&mut self, r: usize) {
        let (Some((from, to)), Some(part)) = (&self.skip, self.parts.get_mut(r)) else {
            return;
        };
        if part.start >= *from && part.start < *to {
            part.start = if *to < part.end { to.clone() } else { part.end.clone() };
        }
    }

    /// What reader `r` should do next.
    pub fn next(&mut self, r: usize) -> Next {
        // A part taken over may lie wholly in the skipped range: take another. Each take
        // shrinks a part, so this ends; the bound is for safety.
        for _ in 0..64 {
            self.jump_skip(r);
            let Some(mine) = self.parts.get(r) else {
                return Next::Done;
            };
            if !mine.is_empty() {
                return self.read_next(r);
            }
            if !self.take_over(r) {
                // Nothing to take now; a busy reader's part may be cut once its request is back.
                return if self.parts.iter().any(|p| !p.is_empty()) {
                    Next::Wait
                } else {
                    Next::Done
                };
            }
        }
        Next::Wait
    }

    /// Reader `r`'s next request in its (non-empty) part.
    fn read_next(&mut self, r: usize) -> Next {
        let skip_from = self.skip.as_ref().map(|(from, _)| from.clone());
        let Some(part) = self.parts.get_mut(r) else {
            return Next::Done;
        };
        let len = part.once.take().unwrap_or(part.depth).min(part.start.len());
        let mut end = match ancestor_end(&part.start, len) {
            Some(e) if e < part.end => e,
            _ => part.end.clone(),
        };
        if let Some(from) = skip_from.filter(|from| part.start < *from && *from < end) {
            end = from;
        }
        part.in_flight = Some(end.clone());
        if let Some(busy) = self.busy.get_mut(r) {
            *busy = true;
        }
        Next::Read {
            start: part.start.clone(),
            end,
        }
    }

    /// Reader `r`'s request came back: `count` keys in its range (etcd counts past the
    /// limit), `more` if it held more than a page, and the last key returned.
    pub fn answered(&mut self, r: usize, count: i64, more: bool, last: Option<&[u8]>) {
        let page = self.page;
        self.requests += 1;
        self.walked += count.max(0) as u64;
        let Some(part) = self.parts.get_mut(r) else { return };
        let Some(end) = part.in_flight.take() else { return };
        let before = part.start.len();
        match (more, last) {
            (true, Some(last)) => {
                part.start = last.to_vec();
                part.start.push(0);
            }
            _ => part.start = end,
        }
        if count == 0 {
            // A boundary (see the type's docs): the rest of its parent, then the subtree of
            // the position that follows.
            let len = part.start.len();
            part.once = Some(if len >= before {
                len.saturating_sub(1).max(1)
            } else {
                len
            });
            return;
        }
        let chain = part.last_wide.is_some_and(|wide| count * 2 > wide);
        part.last_wide = (count > 2 * page).then_some(count);
        if count > 8 * page && (!part.fitted || chain) {
            // Far too wide with nothing to go by (the first request walks the whole prefix),
            // or one byte narrower did not halve it (a level that does not split: `groups/`,
            // a group-name stem): go to the narrowest range and widen from there, a few cheap
            // requests instead of walking it all again per byte.
            part.floor = part.depth + 1;
            part.depth = part.start.len();
        } else if count > 2 * page {
            // Too wide here: never widen to this ancestor again nearby (siblings are alike).
            part.floor = part.depth + 1;
            part.depth += 1;
        } else {
            part.fitted = true;
            if !more && count < page / 64 && part.depth > part.floor + 1 {
                part.depth -= 2;
            } else if !more && count < page / 2 && part.depth > part.floor {
                part.depth -= 1;
            } else if !more && count < page / 32 && part.depth == part.floor {
                // Much sparser here than where the floor was set: let it go.
                part.floor = part.floor.saturating_sub(1);
                part.depth = part.floor;
            }
        }
        part.depth = part.depth.clamp(1, part.start.len().max(1));
    }

    /// Gives idle reader `r` the far part of the widest unfinished part, cut at the end of
    /// that part's coarsest ancestor that still leaves both sides something to read.
    fn take_over(&mut self, r: usize) -> bool {
        let mut best: Option<(usize, usize, Vec<u8>)> = None; // (common prefix, victim, cut)
        for (v, part) in self.parts.iter().enumerate() {
            if v == r || part.is_empty() {
                continue;
            }
            let common = common_prefix(&part.start, &part.end);
            if best.as_ref().is_some_and(|(c, _, _)| *c <= common) {
                continue;
            }
            if let Some(cut) = cut_point(part) {
                best = Some((common, v, cut));
            }
        }
        let Some((_, v, cut)) = best else { return false };
        let Some(victim) = self.parts.get_mut(v) else {
            return false;
        };
        let end = std::mem::replace(&mut victim.end, cut.clone());
        let mut taken = Part::new(cut, end, victim.depth, victim.floor);
        // Sizes near the victim are known: no need to start from the narrowest range.
        taken.fitted = victim.fitted;
        match self.parts.get_mut(r) {
            Some(slot) => {
                *slot = taken;
                true
            }
            None => false,
        }
    }
}

/// Where to cut `part` in two: the end of the shortest ancestor of its position that ends
/// inside it and not before its request in flight.
fn cut_point(part: &Part) -> Option<Vec<u8>> {
    let floor = part.in_flight.as_ref().unwrap_or(&part.start);
    let first = common_prefix(&part.start, &part.end) + 1;
    (first..=part.start.len())
        .filter_map(|len| ancestor_end(&part.start, len))
        .find(|cut| cut > floor && *cut < part.end)
}

/// The end of `key`'s ancestor of length `len`: the smallest key above every key that
/// starts with `key[..len]`. `None` when there is none (all 0xff).
fn ancestor_end(key: &[u8], len: usize) -> Option<Vec<u8>> {
    let ancestor = key.get(..len.min(key.len()))?;
    let end = prefix_end(ancestor);
    (end != [0]).then_some(end)
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Drives a plan against an in-memory key set as etcd 3.4 would answer, readers
    /// concurrent: each round every reader with work sends a request, then all are answered.
    /// Returns the keys read (by reader), the index entries walked (every key in each
    /// requested range) and the requests.
    fn run_readers(
        keys: &BTreeSet<Vec<u8>>,
        prefix: &[u8],
        readers: usize,
        page: i64,
    ) -> (Vec<Vec<Vec<u8>>>, usize, usize) {
        let mut plan = Plan::new(prefix, readers, page);
        let mut read = vec![Vec::new(); readers];
        let (mut walked, mut requests) = (0, 0);
        loop {
            let mut round = Vec::new();
            let mut done = 0;
            for r in 0..readers {
                match plan.next(r) {
                    Next::Read { start, end } => {
                        assert!(start < end, "empty range asked: {start:?}..{end:?}");
                        round.push((r, start, end));
                    }
                    Next::Wait => {}
                    Next::Done => done += 1,
                }
            }
            if round.is_empty() {
                assert_eq!(done, readers, "readers wait with nobody reading");
                return (read, walked, requests);
            }
            for (r, start, end) in round {
                requests += 1;
                let in_range: Vec<&Vec<u8>> = keys.range(start..end).collect();
                walked += in_range.len();
                let got: Vec<Vec<u8>> = in_range.iter().take(page as usize).map(|k| k.to_vec()).collect();
                let more = in_range.len() > got.len();
                plan.answered(r, in_range.len() as i64, more, got.last().map(|k| k.as_slice()));
                read[r].extend(got);
            }
        }
    }

    #[test]
    fn a_skipped_prefix_is_never_read_and_costs_no_request() {
        // 2,000 groups of 8 ranks and their hosts' copies (a host per 8 ranks, as agents
        // write them): without the skip the copies' thousands of tiny prefixes cost extra
        // requests; with it none reaches them, every other key is read once, and the
        // requests are those of the same keys without copies.
        let mut keys = layout(2_000, 0, 8);
        let without_copies = keys.clone();
        for g in 0..2_000 {
            for r in 0..8 {
                keys.insert(format!("/p/v1/groups/_hosts/host-{g}/scale-{g}/{r}/live").into_bytes());
            }
        }
        keys.insert(b"/p/v1/coordinators/c1".to_vec());
        for readers in [1, 4] {
            let (_, _, unskipped) = run(&keys, b"/p/v1/", readers, PAGE);
            let (_, _, no_copies) = run(&without_copies, b"/p/v1/", readers, PAGE);
            let mut plan = Plan::new(b"/p/v1/", readers, PAGE).skipping(b"/p/v1/groups/_hosts/");
            let mut read = Vec::new();
            let mut requests = 0;
            loop {
                let mut round = Vec::new();
                for r in 0..readers {
                    if let Next::Read { start, end } = plan.next(r) {
                        round.push((r, start, end));
                    }
                }
                if round.is_empty() {
                    break;
                }
                for (r, start, end) in round {
                    assert!(
                        end <= b"/p/v1/groups/_hosts/".to_vec() || start >= b"/p/v1/groups/_hosts0".to_vec(),
                        "a request reaches into the skipped range: {start:?}..{end:?}"
                    );
                    requests += 1;
                    let in_range: Vec<&Vec<u8>> = keys.range(start..end).collect();
                    let got: Vec<Vec<u8>> = in_range.iter().take(PAGE as usize).map(|k| k.to_vec()).collect();
                    let more = in_range.len() > got.len();
                    plan.answered(r, in_range.len() as i64, more, got.last().map(|k| k.as_slice()));
                    read.extend(got);
                }
            }
            read.sort();
            let want: Vec<Vec<u8>> = keys
                .range(b"/p/v1/".to_vec()..b"/p/v10".to_vec())
                .filter(|k| !k.starts_with(b"/p/v1/groups/_hosts/"))
                .cloned()
                .collect();
            assert!(
                read == want,
                "readers {readers}: read {} keys, want {}",
                read.len(),
                want.len()
            );
            assert!(
                requests <= no_copies + 1 && requests < unskipped,
                "{requests} requests with the skip, {unskipped} without, {no_copies} with no copies at all"
            );
        }
    }

    fn run(keys: &BTreeSet<Vec<u8>>, prefix: &[u8], readers: usize, page: i64) -> (Vec<Vec<u8>>, usize, usize) {
        let (read, walked, requests) = run_readers(keys, prefix, readers, page);
        (read.concat(), walked, requests)
    }

    fn layout(groups: usize, rooms_per_group: usize, ranks: u32) -> BTreeSet<Vec<u8>> {
        let mut keys = BTreeSet::new();
        let mut x: u64 = 7;
        for g in 0..groups {
            for r in 0..ranks {
                keys.insert(format!("/p/v1/groups/scale-{g}/ranks/{r}/live").into_bytes());
            }
            for _ in 0..rooms_per_group {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let room = x >> 1;
                for r in 0..ranks {
                    keys.insert(format!("/p/v1/groups/scale-{g}/rooms/{room}/ranks/{r}").into_bytes());
                }
            }
        }
        keys.insert(b"/p/v1/coordinators/a".to_vec());
        // Neighbours outside the prefix must never be read.
        keys.insert(b"/p/v0/x".to_vec());
        keys.insert(b"/p/v10".to_vec());
        keys
    }

    #[test]
    fn every_key_is_read_once_whatever_the_number_of_readers() {
        let keys = layout(300, 20, 8);
        let inside: Vec<Vec<u8>> = keys.iter().filter(|k| k.starts_with(b"/p/v1/")).cloned().collect();
        for readers in [1, 2, 3, 4, 8] {
            let (mut read, _, _) = run(&keys, b"/p/v1/", readers, 500);
            let n = read.len();
            read.sort();
            read.dedup();
            assert_eq!(read.len(), n, "{readers} readers read a key twice");
            assert_eq!(read, inside, "{readers} readers");
        }
    }

    #[test]
    fn requests_walk_a_bounded_multiple_of_the_keys_not_their_square() {
        let keys = layout(2_000, 60, 8); // ~1M keys would be slow in a unit test; 976k/8
        let n = keys.len();
        let (read, walked, requests) = run(&keys, b"/p/v1/", 1, 5_000);
        assert_eq!(read.len(), n - 2);
        // Unbounded paging walks n + (n - page) + ... ~ n^2 / (2 page) = 98x n here.
        assert!(walked < 5 * n, "walked {walked} index entries for {n} keys");
        assert!(requests < n / 100, "{requests} requests for {n} keys");
    }

    #[test]
    fn a_shared_group_name_stem_is_not_walked_once_per_byte() {
        // 700 groups `pd-N`: narrowing byte by byte through `groups/pd-` would walk nearly
        // every key at each of ten levels before any range fits a page.
        let mut keys = BTreeSet::new();
        for g in 0..700 {
            for r in 0..137 {
                keys.insert(format!("/rr/v1/groups/pd-{g}/rooms/{}/ranks/{}", r / 8 * 7919, r % 8).into_bytes());
            }
        }
        let n = keys.len();
        let (read, walked, _) = run(&keys, b"/rr/v1/", 1, 5_000);
        assert_eq!(read.len(), n);
        assert!(walked < 3 * n, "walked {walked} index entries for {n} keys");
    }

    #[test]
    fn parallel_readers_share_the_work() {
        let keys = layout(2_000, 20, 8);
        let mut plan = Plan::new(b"/p/v1/", 4, 500);
        // Reader 0's first request covers everything; the others wait until it is back.
        let Next::Read { start, end } = plan.next(0) else {
            panic!("reader 0 reads first")
        };
        assert_eq!((start.as_slice(), end.as_slice()), (&b"/p/v1/"[..], &b"/p/v10"[..]));
        assert_eq!(plan.next(1), Next::Wait);
        let all: Vec<&Vec<u8>> = keys.range(start..end).collect();
        plan.answered(0, all.len() as i64, true, Some(all[499]));
        // Now its part can be cut: the idle readers get disjoint parts after its position.
        let (Next::Read { start: a, .. }, Next::Read { start: b, .. }) = (plan.next(1), plan.next(2)) else {
            panic!("idle readers take parts")
        };
        assert!(a > *all[499] && b > *all[499] && a != b);
        // Over the whole read, every reader reads a fair share.
        let (read, walked, _) = run_readers(&keys, b"/p/v1/", 4, 5_000);
        let n = keys.len();
        for (r, got) in read.iter().enumerate() {
            assert!(got.len() > n / 10, "reader {r} read {} of {n} keys", got.len());
        }
        assert!(walked < 4 * n, "walked {walked} for {n} keys");
    }

    #[test]
    fn an_empty_prefix_is_one_request() {
        let keys = layout(3, 2, 2);
        let (read, walked, requests) = run(&keys, b"/q/", 4, 500);
        assert!(read.is_empty());
        assert_eq!((walked, requests), (0, 1));
    }

    #[test]
    fn cuts_fall_inside_a_part_and_after_its_request_in_flight() {
        let mut part = Part::new(b"/p/groups/scale-1/rooms/5".to_vec(), b"/p/groups0".to_vec(), 25, 0);
        part.in_flight = Some(b"/p/groups/scale-1/rooms/6".to_vec());
        assert_eq!(cut_point(&part).unwrap(), b"/p/groups/t".to_vec());
        let mut narrow = Part::new(b"/p/groups/a/rooms/5".to_vec(), b"/p/groups/a/rooms/6".to_vec(), 19, 0);
        narrow.in_flight = Some(b"/p/groups/a/rooms/6".to_vec());
        assert_eq!(cut_point(&narrow), None, "nothing left outside the request in flight");
    }

    #[test]
    fn ancestor_ends() {
        assert_eq!(ancestor_end(b"abc", 2), Some(b"ac".to_vec()));
        assert_eq!(ancestor_end(b"abc", 9), Some(b"abd".to_vec()));
        assert_eq!(ancestor_end(&[0xff, 0xff], 2), None);
        assert_eq!(ancestor_end(b"a\xff", 2), Some(b"b".to_vec()));
    }
}
