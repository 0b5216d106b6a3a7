//! The I/O shell around [`Follower`]: connects, reads snapshots, opens and reads the watch,
//! and hands what etcd says to a [`Mirror`] (the coordinator's index, node-watch's ranks).
//! Every decision (when to retry, reload, give a watch up) is the follower's.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, WatchOptions, WatchResponse, WatchStream};
use rootrank_core::Event;
use tracing::{debug, info, warn};

use crate::follower::{Action, Follower, Input, WatchMessage};
use crate::{EtcdAccess, SnapshotStats};

/// What a follower keeps equal to etcd. Called from the follow loop only, never concurrently.
pub trait Mirror {
    /// A snapshot starts: build fresh state beside the one serving now.
    fn snapshot_started(&mut self);
    /// A page of the snapshot, in no particular order.
    fn snapshot_page(&mut self, page: Vec<Event>);
    /// The snapshot is complete at `revision`: the fresh state replaces the old.
    fn snapshot_finished(&mut self, stats: &SnapshotStats);
    /// The events of one or more whole revisions, in revision order.
    fn apply(&mut self, events: Vec<Event>);
    /// etcd confirmed a new watch: the copy is current.
    fn current(&mut self) {}
    /// The watch is lost (or a new one could not be opened): the copy is stale.
    fn stale(&mut self, _why: &str) {}
    /// A watch is being opened; `restart` for every one after the first.
    fn watch_opening(&mut self, _from_revision: i64, _restart: bool) {}
    /// The copy's own next deadline while watching (the coordinator's pending rooms).
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }
    fn handle_timeout(&mut self, _now: Instant) {}
    /// Whether whoever reads the copy has gone: the loop then returns.
    fn is_closed(&self) -> bool {
        false
    }
    /// A part of the prefix the snapshot need not read (the watch still delivers it).
    fn snapshot_skips(&self) -> Option<String> {
        None
    }
}

/// Keeps `mirror` equal to everything under `prefix` until the copy is closed (or for ever).
/// `readers`: parallel snapshot readers (one for a per-host watchdog, whose memory matters).
pub async fn follow(access: &EtcdAccess, prefix: &str, readers: usize, mirror: &mut impl Mirror) {
    let mut follower = Follower::standard();
    let mut client: Option<Client> = None;
    let mut watch: Option<WatchStream> = None;
    // The events received and not applied yet: those of the response being handled, after
    // the fragments before it; applied at the follower's `Apply`, dropped with the watch.
    let mut events: Vec<Event> = Vec::new();
    let mut actions: VecDeque<Action> = follower.start().into();
    // Whole messages until one is too large for a gRPC message (see `open`).
    let mut fragments = false;
    loop {
        while let Some(action) = actions.pop_front() {
            let now = Instant::now;
            match action {
                Action::Connect => {
                    let input = match crate::connect(access).await {
                        Ok(c) => {
                            client = Some(c);
                            Input::Connected
                        }
                        Err(e) => {
                            warn!(error = %e, "cannot reach etcd; retrying");
                            Input::ConnectFailed(e.to_string())
                        }
                    };
                    actions.extend(follower.handle(input, now()));
                }
                Action::LoadSnapshot => {
                    let Some(c) = &client else { continue };
                    let input = load(c, prefix, readers, mirror).await;
                    actions.extend(follower.handle(input, now()));
                }
                Action::OpenWatch { from_revision, restart } => {
                    let Some(c) = &mut client else { continue };
                    mirror.watch_opening(from_revision, restart);
                    let deadline = follower
                        .poll_timeout()
                        .unwrap_or_else(|| now() + crate::REQUEST_TIMEOUT);
                    let input =
                        match tokio::time::timeout_at(deadline.into(), open(c, prefix, from_revision, fragments)).await
                        {
                            Ok(Ok(w)) => {
                                watch = Some(w);
                                Input::WatchOpened
                            }
                            Ok(Err(e)) => Input::OpenFailed(e.to_string()),
                            // The follower's deadline gives it up.
                            Err(_) => continue,
                        };
                    actions.extend(follower.handle(input, now()));
                }
                Action::DropWatch => {
                    watch = None;
                    events.clear();
                }
                Action::RequestProgress => {
                    if let Some(stream) = &mut watch {
                        let _ = tokio::time::timeout(crate::PROGRESS_EVERY, stream.request_progress()).await;
                    }
                }
                Action::Apply { .. } => {
                    mirror.apply(std::mem::take(&mut events));
                    actions.extend(follower.handle(Input::Applied, now()));
                }
                Action::Current => {
                    info!(revision = follower.revision(), "watching etcd; current");
                    mirror.current();
                }
                Action::Stale { why } => {
                    warn!(why, "not current: the watch on etcd is lost");
                    mirror.stale(&why);
                }
            }
        }
        if mirror.is_closed() {
            return;
        }
        let watching = watch.is_some();
        let mirror_deadline = if watching { mirror.poll_timeout() } else { None };
        tokio::select! {
            message = next_message(&mut watch) => {
                let now = Instant::now();
                let input = match message {
                    Ok(Some(m)) => {
                        let (input, read) = summarize(m);
                        if read.len() >= 1024 {
                            debug!(events = read.len(), "watch message received");
                        }
                        events.extend(read);
                        input
                    }
                    Ok(None) => Input::StreamEnded("the watch stream ended".into()),
                    Err(e) => {
                        let why = e.to_string();
                        if !fragments && is_too_large(&why) {
                            warn!(error = %why, "a watch message was too large for gRPC; watching in fragments from now on (etcd splits them slowly)");
                            fragments = true;
                        }
                        Input::StreamEnded(why)
                    }
                };
                actions = follower.handle(input, now).into();
            }
            _ = sleep_until(follower.poll_timeout()) => {
                actions = follower.handle_timeout(Instant::now()).into();
            }
            _ = sleep_until(mirror_deadline) => {
                mirror.handle_timeout(Instant::now());
            }
            // A closed copy is noticed within a second even when etcd is quiet.
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

async fn load(client: &Client, prefix: &str, readers: usize, mirror: &mut impl Mirror) -> Input {
    mirror.snapshot_started();
    let started = Instant::now();
    let skip = mirror.snapshot_skips();
    match crate::snapshot_pages_skipping(
        client,
        prefix,
        skip.as_deref(),
        crate::monotonic_ms(),
        readers,
        |page| mirror.snapshot_page(page),
    )
    .await
    {
        Ok(stats) => {
            info!(
                revision = stats.revision,
                keys = stats.keys,
                requests = stats.requests,
                etcd_walked = stats.walked,
                readers = stats.readers,
                busy_readers = stats.busy_readers,
                read_s = started.elapsed().as_secs_f64(),
                "snapshot read"
            );
            mirror.snapshot_finished(&stats);
            Input::Loaded {
                revision: stats.revision,
            }
        }
        Err(e) => {
            warn!(error = %e, "snapshot failed; retrying");
            Input::LoadFailed(e.to_string())
        }
    }
}

async fn open(
    client: &mut Client,
    prefix: &str,
    from_revision: i64,
    fragments: bool,
) -> Result<WatchStream, etcd_client::Error> {
    // One revision can hold 100,000 deletes (a lease shared by a fleet's keys revoked), ~5 MB
    // without previous values. It comes as one message, which the follower accepts up to
    // `WATCH_MESSAGE_LIMIT`. Fragments are asked for only after a message was larger than
    // that: etcd 3.4 splits a response by re-measuring the whole fragment after every event
    // it adds (`sendFragments`), quadratic in the events, so 100,000 deletes took it 30 s to
    // send in fragments against 1.2 s whole (`rootrank-bench mass-death`).
    let mut opts = WatchOptions::new()
        .with_prefix()
        .with_start_revision(from_revision)
        .with_progress_notify();
    if fragments {
        opts = opts.with_fragment();
    }
    debug!(from_revision, fragments, "opening the watch");
    client
        .watch_client()
        .max_decoding_message_size(WATCH_MESSAGE_LIMIT)
        .watch(prefix, Some(opts))
        .await
}

/// Whether a watch ended on a message larger than gRPC allows, on either side.
fn is_too_large(error: &str) -> bool {
    error.contains("message length too large") || error.contains("larger than max")
}

/// The largest watch message the follower accepts (a fragment is at most etcd's request
/// limit; a whole revision of 1,000,000 deletes is ~50 MB).
const WATCH_MESSAGE_LIMIT: usize = 256 * 1024 * 1024;

async fn next_message(watch: &mut Option<WatchStream>) -> Result<Option<WatchResponse>, etcd_client::Error> {
    match watch {
        Some(stream) => stream.message().await,
        None => std::future::pending().await,
    }
}

/// The follower's summary of a response, and its events as the core's [`Event`]s.
fn summarize(m: WatchResponse) -> (Input, Vec<Event>) {
    let now = crate::monotonic_ms();
    let mut last = None;
    let mut events = Vec::with_capacity(m.events().len());
    for ev in m.events() {
        let Some(kv) = ev.kv() else { continue };
        last = Some(kv.mod_revision());
        events.push(match ev.event_type() {
            EventType::Put => crate::put_event(kv.clone(), now),
            EventType::Delete => Event::Delete {
                key: kv.key().to_vec(),
                revision: kv.mod_revision(),
                observed_at_ms: now,
            },
        });
    }
    let summary = WatchMessage {
        created: m.created(),
        compact_revision: m.compact_revision(),
        canceled: m.canceled().then(|| m.cancel_reason().to_string()),
        last_event_revision: last,
        fragment: m.0.fragment,
        header_revision: m.header().map_or(0, |h| h.revision()),
    };
    (Input::Message(summary), events)
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::is_too_large;

    #[test]
    fn a_message_over_either_grpc_limit_is_told_from_other_stream_errors() {
        // tonic's decoder (this side) and grpc-go's sender (etcd's side), as etcd-client shows them.
        assert!(is_too_large(
            "grpc request error: status: OutOfRange, message: \"Error, decoded message length too large: found 300000000 bytes, the limit is: 268435456 bytes\""
        ));
        assert!(is_too_large(
            "grpc request error: status: ResourceExhausted, message: \"trying to send message larger than max (5388890 vs. 2097152)\""
        ));
        assert!(!is_too_large(
            "grpc request error: status: Unavailable, message: \"transport error\""
        ));
    }
}
