//! The HTTP API of SPEC section 6. Handlers only parse, lock the index for reading, and
//! serialize; the verdict itself comes from the core.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Path, RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use rootrank_core::{GroupId, RoomId, Status, VerdictQuery};
use serde_json::json;

use crate::Shared;

/// Longest URI accepted; anything longer is bad input, answered before any work.
pub const MAX_URI_BYTES: usize = 8 * 1024;
/// Longest long poll (SPEC: `wait_ms` 0..=30000).
pub const MAX_WAIT_MS: u64 = 30_000;
/// Long polls (`wait_ms` > 0) waiting at once; past it the answer is 503 with `Retry-After`,
/// so a flood of waiters cannot exhaust the server.
pub const MAX_LONG_POLLS: usize = 4096;

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/v1/rooms/{room}/verdict", get(verdict))
        .route("/v1/groups", get(groups))
        .route("/v1/groups/{group}", get(group))
        .route("/v1/failures", get(failures))
        .route("/v1/events", get(events))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route; see SPEC section 6 (GET /v1/rooms/{room}/verdict, /v1/groups, /v1/failures, /v1/events, /v1/health, /metrics, /healthz, /readyz)") })
        .method_not_allowed_fallback(|| async { ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "rootrank's API is read-only: use GET") })
        .layer(middleware::from_fn_with_state(shared.clone(), authorize))
        .layer(middleware::from_fn_with_state(shared.clone(), observe))
        .with_state(shared)
}

/// With `--auth-token-file`, every route but the static page, `/healthz`, `/readyz` and
/// (unless `--auth-metrics`) `/metrics` wants `Authorization: Bearer TOKEN`: what ranks'
/// hosts, pids and tracebacks say is for the operators who hold it. The page itself carries
/// no data (it asks for the token and sends it with each request it makes).
async fn authorize(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let Some(token) = &shared.auth_token else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    let open = matches!(path, "/" | "/healthz" | "/readyz") || (path == "/metrics" && !shared.auth_metrics);
    let allowed = open
        || req
            .headers()
            .get(header::AUTHORIZATION)
            .is_some_and(|v| v.len() <= rootrank_tls::MAX_TOKEN_BYTES + 16 && token.accepts(v.as_bytes()));
    if allowed {
        return next.run(req).await;
    }
    // Counted as rootrank_http_request_duration_seconds{status="401"} by `observe` (outside).
    let mut resp = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "this coordinator wants a bearer token: send Authorization: Bearer TOKEN (rootrank why/status: --token-file or ROOTRANK_TOKEN_FILE)",
    )
    .into_response();
    resp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static("Bearer realm=\"rootrank\""),
    );
    resp
}

/// A JSON error: `{"error": {"code", "message"}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
    /// Adds `Retry-After` (seconds) to a 503.
    fn retry_after(mut self, secs: u32) -> Self {
        self.retry_after = Some(secs);
        self
    }
    fn bad(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, code, message)
    }
    fn not_ready() -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "the coordinator has not finished loading from etcd, or its watch is down; retry shortly (see /readyz)",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(json!({"error": {"code": self.code, "message": self.message}}));
        match self.retry_after {
            Some(secs) => (self.status, [(header::RETRY_AFTER, secs.to_string())], body).into_response(),
            None => (self.status, body).into_response(),
        }
    }
}

/// Times every request into `rootrank_http_request_duration_seconds`, and turns away
/// oversized URIs before any handler sees them.
async fn observe(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let start = Instant::now();
    let mut route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
    // Long polls wait on purpose: keep them out of the verdict route's latency.
    let long_poll = req.uri().query().is_some_and(|q| {
        q.split('&').any(|kv| {
            kv.strip_prefix("wait_ms=")
                .is_some_and(|v| !v.trim_start_matches('0').is_empty())
        })
    });
    if long_poll {
        route.push_str(" (wait_ms)");
    }
    let uri_len = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    let resp = if uri_len > MAX_URI_BYTES {
        ApiError::bad("request_too_large", format!("request URI over {MAX_URI_BYTES} bytes")).into_response()
    } else {
        next.run(req).await
    };
    shared
        .metrics
        .http_duration
        .with_label_values(&[&route, resp.status().as_str()])
        .observe(start.elapsed().as_secs_f64());
    resp
}

fn parse_query(raw: Option<String>, allowed: &[&str]) -> Result<HashMap<String, String>, ApiError> {
    let pairs: Vec<(String, String)> = match raw.as_deref() {
        None | Some("") => Vec::new(),
        Some(q) => {
            serde_urlencoded::from_str(q).map_err(|e| ApiError::bad("invalid_query", format!("query string: {e}")))?
        }
    };
    let mut out = HashMap::new();
    for (k, v) in pairs {
        if !allowed.contains(&k.as_str()) {
            return Err(ApiError::bad(
                "invalid_query",
                format!(
                    "unknown query parameter {:?}; allowed: {}",
                    truncate(&k),
                    allowed.join(", ")
                ),
            ));
        }
        if out.insert(k.clone(), v).is_some() {
            return Err(ApiError::bad(
                "invalid_query",
                format!("query parameter {k:?} given twice"),
            ));
        }
    }
    Ok(out)
}

fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

fn parse_group(s: &str) -> Result<GroupId, ApiError> {
    GroupId::new(s).map_err(|e| ApiError::bad("invalid_group", e.to_string()))
}

fn ensure_ready(shared: &Shared) -> Result<(), ApiError> {
    if shared.ready.load(Ordering::SeqCst) {
        Ok(())
    } else {
        Err(ApiError::not_ready())
    }
}

async fn verdict(
    State(shared): State<Arc<Shared>>,
    room: Result<Path<String>, axum::extract::rejection::PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let Path(room) = room.map_err(|e| ApiError::bad("invalid_room", e.body_text()))?;
    let room = RoomId::parse(&room).map_err(|e| ApiError::bad("invalid_room", e.to_string()))?;
    let q = parse_query(raw, &["group", "wait_ms", "asking_rank", "view", "min_revision"])?;
    let compact = match q.get("view").map(String::as_str) {
        None | Some("full") => false,
        Some("compact") => true,
        Some(other) => {
            return Err(ApiError::bad(
                "invalid_view",
                format!("view {:?}: \"compact\" or \"full\"", truncate(other)),
            ))
        }
    };
    let min_revision = match q.get("min_revision") {
        None => None,
        Some(r) => match r.parse::<i64>() {
            Ok(n) if n >= 0 && r.bytes().all(|c| c.is_ascii_digit()) => Some(n),
            _ => {
                return Err(ApiError::bad(
                    "invalid_min_revision",
                    format!(
                        "min_revision {:?}: a non-negative integer (an etcd revision)",
                        truncate(r)
                    ),
                ))
            }
        },
    };
    let group = q.get("group").map(|g| parse_group(g)).transpose()?;
    let wait_ms = match q.get("wait_ms") {
        None => 0,
        Some(w) => match w.parse::<u64>() {
            Ok(ms) if ms <= MAX_WAIT_MS && w.bytes().all(|c| c.is_ascii_digit()) => ms,
            _ => {
                return Err(ApiError::bad(
                    "invalid_wait_ms",
                    format!("wait_ms {:?}: an integer 0..={MAX_WAIT_MS}", truncate(w)),
                ))
            }
        },
    };
    let asking_rank = q
        .get("asking_rank")
        .map(|r| rootrank_core::ids::parse_rank(r).map_err(|e| ApiError::bad("invalid_asking_rank", e.to_string())))
        .transpose()?;
    ensure_ready(&shared)?;
    // Held for the whole wait; dropped with the request.
    let _slot = if wait_ms > 0 {
        Some(shared.long_polls.clone().try_acquire_owned().map_err(|_| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "too_many_waiters",
                "the most long polls this replica lets wait (serve --max-long-polls) are waiting; retry in a second, or ask another replica",
            )
            .retry_after(1)
        })?)
    } else {
        None
    };
    let asked_at_ms = rootrank_store::monotonic_ms();
    let deadline = Instant::now() + Duration::from_millis(wait_ms);
    let mut revisions = shared.revision_tx.subscribe();
    let waiter = shared.waiters.watch(room);
    let span = tracing::debug_span!("verdict", %room, group = group.as_ref().map(|g| g.as_str()), asking_rank);
    span.in_scope(|| tracing::debug!(wait_ms, min_revision, "verdict asked"));
    let query = || VerdictQuery {
        room,
        group: group.clone(),
        asked_at_ms,
        now_ms: rootrank_store::monotonic_ms(),
    };
    loop {
        // Armed before looking, so a wake between the look and the wait is not lost.
        let woken = waiter.notify().notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        revisions.mark_unchanged();
        // A replica that lost etcd while this request waited answers 503 at once (it is woken).
        ensure_ready(&shared)?;
        let (current, changes_in_ms) = {
            let index = shared.index.read().map_err(|_| ApiError::not_ready())?;
            let current = min_revision.is_none_or(|m| index.revision() >= m);
            let now = Instant::now();
            // The wake check asks only for the status; the verdict is built once, at the end.
            let (status, changes_in_ms) = index.verdict_wait(&query());
            if current && (now >= deadline || status == Status::Resolved) {
                let (status, body) = shared.verdicts.answer(&index, &query(), compact)?;
                drop(index);
                shared.metrics.verdicts.with_label_values(&[status.as_str()]).inc();
                return Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response());
            }
            if !current && now >= deadline {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "behind",
                    format!(
                        "this replica has applied etcd revision {} and min_revision is {}; ask another replica or wait (wait_ms)",
                        index.revision(),
                        min_revision.unwrap_or(0)
                    ),
                )
                .retry_after(1));
            }
            (current, changes_in_ms)
        };
        // Wake when something about this room changes (or about every room: a rank's state, a
        // reload, the loss of etcd), when the verdict may change by time alone, when the wait
        // ends; a poll behind `min_revision` also on every applied revision.
        let now = Instant::now();
        let mut until = deadline;
        if let Some(ms) = changes_in_ms {
            until = until.min(now + Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
        }
        let left = until.saturating_duration_since(now);
        if current {
            let _ = tokio::time::timeout(left, woken).await;
        } else {
            let _ = tokio::time::timeout(left, async {
                tokio::select! {
                    _ = &mut woken => {}
                    _ = revisions.changed() => {}
                }
            })
            .await;
        }
    }
}

/// Serialized resolved verdicts, keyed by (room, group, view) and valid for one index
/// revision. A verdict is a function of the index at a revision, so this is exact; a resolved
/// one (rooms with records) does not depend on the time of the question either. Pending and
/// unknown answers depend on the clock and are never cached. Cleared whenever the revision
/// moves or it holds too many answers.
#[derive(Default)]
pub struct VerdictCache {
    inner: std::sync::Mutex<CacheInner>,
}

#[derive(Default)]
struct CacheInner {
    revision: i64,
    answers: HashMap<(RoomId, Option<GroupId>, bool), bytes::Bytes>,
}

const CACHE_ANSWERS: usize = 100_000;

impl VerdictCache {
    fn answer(
        &self,
        index: &rootrank_core::Index,
        q: &VerdictQuery,
        compact: bool,
    ) -> Result<(Status, bytes::Bytes), ApiError> {
        let key = (q.room, q.group.clone(), compact);
        if let Ok(c) = self.inner.lock() {
            if c.revision == index.revision() {
                if let Some(body) = c.answers.get(&key) {
                    return Ok((Status::Resolved, body.clone()));
                }
            }
        }
        let v = index.verdict(q);
        let encoded = if compact {
            serde_json::to_vec(&rootrank_core::CompactVerdict::from(&v))
        } else {
            serde_json::to_vec(&v)
        };
        let body = bytes::Bytes::from(encoded.map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "encode",
                format!("verdict did not encode: {e}"),
            )
        })?);
        let cacheable = v.status == Status::Resolved
            && v.evidence
                .iter()
                .any(|e| e.kind == rootrank_core::EvidenceKind::RoomRecord);
        if cacheable {
            if let Ok(mut c) = self.inner.lock() {
                if c.revision != index.revision() || c.answers.len() >= CACHE_ANSWERS {
                    c.answers.clear();
                    c.revision = index.revision();
                }
                c.answers.insert(key, body.clone());
            }
        }
        Ok((v.status, body))
    }
}

/// Most groups one `GET /v1/groups?limit=` page holds.
const GROUPS_PAGE_MAX: usize = 10_000;

async fn groups(State(shared): State<Arc<Shared>>, RawQuery(raw): RawQuery) -> Result<Response, ApiError> {
    let q = parse_query(raw, &["limit", "after"])?;
    let limit = q
        .get("limit")
        .map(|l| match l.parse::<usize>() {
            Ok(n) if (1..=GROUPS_PAGE_MAX).contains(&n) => Ok(n),
            _ => Err(ApiError::bad(
                "invalid_limit",
                format!("limit {:?}: an integer 1..={GROUPS_PAGE_MAX}", truncate(l)),
            )),
        })
        .transpose()?;
    let after = q.get("after").map(|g| parse_group(g)).transpose()?;
    if after.is_some() && limit.is_none() {
        return Err(ApiError::bad(
            "invalid_query",
            "after= pages through groups and needs limit= (e.g. ?limit=1000&after=GROUP)",
        ));
    }
    ensure_ready(&shared)?;
    let index = shared.index.read().map_err(|_| ApiError::not_ready())?;
    // The revision lets a client that got 410 from /v1/events resume after this answer.
    let body = match limit {
        None => json!({ "groups": index.groups(), "revision": index.revision() }),
        Some(limit) => {
            let (page, next) = index.groups_page(after.as_ref(), limit);
            json!({ "groups": page, "revision": index.revision(), "next": next })
        }
    };
    drop(index);
    Ok(Json(body).into_response())
}

async fn group(
    State(shared): State<Arc<Shared>>,
    group: Result<Path<String>, axum::extract::rejection::PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let Path(group) = group.map_err(|e| ApiError::bad("invalid_group", e.body_text()))?;
    let group = parse_group(&group)?;
    parse_query(raw, &[])?;
    ensure_ready(&shared)?;
    let view = shared.index.read().map_err(|_| ApiError::not_ready())?.group(&group);
    match view {
        Some(v) => Ok(Json(v).into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_group",
            format!("no rank of group {group} has ever registered or reported (see GET /v1/groups)"),
        )),
    }
}

async fn failures(State(shared): State<Arc<Shared>>, RawQuery(raw): RawQuery) -> Result<Response, ApiError> {
    let q = parse_query(raw, &["group", "limit"])?;
    let group = q.get("group").map(|g| parse_group(g)).transpose()?;
    let limit = match q.get("limit") {
        None => 50,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=1000).contains(&n) => n,
            _ => {
                return Err(ApiError::bad(
                    "invalid_limit",
                    format!("limit {:?}: an integer 1..=1000", truncate(l)),
                ))
            }
        },
    };
    ensure_ready(&shared)?;
    let list = shared
        .index
        .read()
        .map_err(|_| ApiError::not_ready())?
        .recent_failures(group.as_ref(), limit);
    Ok(Json(json!({ "failures": list })).into_response())
}

/// `GET /v1/events?since=REV&group=G` (SPEC v3): see [`crate::events`]. `Last-Event-ID`
/// (what an SSE client sends when it reconnects) wins over `since`.
async fn events(
    State(shared): State<Arc<Shared>>,
    headers: axum::http::HeaderMap,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let q = parse_query(raw, &["since", "group"])?;
    let group = q.get("group").map(|g| parse_group(g)).transpose()?;
    let revision = |what: &str, v: &str| match v.parse::<i64>() {
        Ok(n) if n >= 0 && v.bytes().all(|c| c.is_ascii_digit()) => Ok(n),
        _ => Err(ApiError::bad(
            "invalid_since",
            format!("{what} {:?}: a non-negative integer (an etcd revision)", truncate(v)),
        )),
    };
    let last_event_id = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(revision(
            "Last-Event-ID",
            v.to_str()
                .map_err(|_| ApiError::bad("invalid_since", "Last-Event-ID is not text"))?
                .trim(),
        )?),
    };
    let since = match (last_event_id, q.get("since")) {
        (Some(id), _) => Some(id),
        (None, Some(s)) => Some(revision("since", s)?),
        (None, None) => None,
    };
    ensure_ready(&shared)?;
    let (cursor, from) = match shared.events.start(since) {
        Ok(c) => c,
        Err(crate::events::StartError::Compacted { floor }) => {
            return Err(ApiError::new(
                StatusCode::GONE,
                "compacted",
                format!(
                    "events after revision {} are no longer kept here (this replica has them from revision {floor} on): reload with GET /v1/groups (it carries its revision), then resume with since=that revision",
                    since.unwrap_or(0)
                ),
            ))
        }
    };
    Ok(crate::events::stream(shared.clone(), cursor, from, group))
}

/// `GET /v1/health?group=G[&group=G2...]` (SPEC v3): 200 when every rank of the named groups
/// is live and advancing, else 503 naming the ranks that are not and why.
async fn health(State(shared): State<Arc<Shared>>, RawQuery(raw): RawQuery) -> Result<Response, ApiError> {
    let pairs: Vec<(String, String)> = match raw.as_deref() {
        None | Some("") => Vec::new(),
        Some(q) => {
            serde_urlencoded::from_str(q).map_err(|e| ApiError::bad("invalid_query", format!("query string: {e}")))?
        }
    };
    let mut groups = Vec::new();
    for (k, v) in pairs {
        if k != "group" {
            return Err(ApiError::bad(
                "invalid_query",
                format!(
                    "unknown query parameter {:?}; allowed: group (repeatable)",
                    truncate(&k)
                ),
            ));
        }
        groups.push(parse_group(&v)?);
    }
    if groups.is_empty() || groups.len() > 256 {
        return Err(ApiError::bad(
            "invalid_group",
            "name 1 to 256 groups: /v1/health?group=G&group=G2 (an SGLang instance is one group per DP replica and role)",
        ));
    }
    ensure_ready(&shared)?;
    let index = shared.index.read().map_err(|_| ApiError::not_ready())?;
    let ranks = index.unhealthy(&groups);
    let revision = index.revision();
    drop(index);
    Ok(if ranks.is_empty() {
        (StatusCode::OK, Json(json!({"healthy": true, "revision": revision}))).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"healthy": false, "ranks": ranks, "revision": revision})),
        )
            .into_response()
    })
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    match shared.index.read() {
        Ok(idx) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            shared.metrics.render(&idx),
        )
            .into_response(),
        // A panic while the index was being written: say so, never an empty 200 that a
        // scraper would read as "no series".
        Err(_) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "index_poisoned",
            "the coordinator's index was left inconsistent by a panic; restart this replica",
        )
        .into_response(),
    }
}

/// The operator page (SPEC section 10): one self-contained file, compiled into the binary so
/// it works where nothing can be fetched.
const PAGE: &str = include_str!("page/index.html");

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        PAGE,
    )
        .into_response()
}

async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    let alarm = shared.etcd_alarms.lock().ok().and_then(|a| a.first().copied());
    if let Some(alarm) = alarm {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "etcd_alarm",
            crate::alarms::explain(alarm),
        )
        .into_response();
    }
    if shared.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        ApiError::not_ready().into_response()
    }
}
