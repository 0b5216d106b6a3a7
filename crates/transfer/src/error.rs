//! Typed errors for NIXL transfers, and their mapping onto rootrank's
//! well-known failure reasons.

use std::path::PathBuf;

use nixl_sys::NixlError;

/// What went wrong while loading NIXL or moving bytes with it.
///
/// Every message says what to do next. [`TransferError::reason`] gives the
/// rootrank reason a coordinator reports; [`TransferError::nixl_status`] the
/// NIXL status name when NIXL itself returned the error.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// No directory holding `libnixl_capi.so` was found.
    #[error(
        "NIXL runtime not found: looked for {wanted} in {searched}; \
         run `scripts/fetch-nixl.sh` (or `make nixl`) to unpack it into <repo>/.cache/nixl, \
         or point ROOTRANK_NIXL_DIR at an unpacked nixl-cu12 wheel"
    )]
    LibraryMissing {
        /// The file that was looked for.
        wanted: String,
        /// Every place that was looked at, in order, joined for display.
        searched: String,
    },

    /// `libnixl_capi.so` was found but could not be used.
    #[error(
        "NIXL runtime at {} is unusable: {detail}; \
         re-run `scripts/fetch-nixl.sh` (delete .cache/nixl first) to unpack a fresh copy",
        path.display()
    )]
    LibraryInvalid {
        /// The library file that was tried.
        path: PathBuf,
        /// Why it could not be used (the dynamic loader's message, ...).
        detail: String,
    },

    /// A NIXL call returned an error status.
    #[error("NIXL {op} failed with {status}: {detail}")]
    Backend {
        /// The NIXL operation (`create_backend`, `post_xfer_req`, ...).
        op: &'static str,
        /// The NIXL status name, e.g. `NIXL_ERR_BACKEND`.
        status: String,
        /// Context: peer, sizes, and what to check.
        detail: String,
        /// The remote agent, when the call was a transfer to one.
        peer: Option<String>,
    },

    /// A transfer to an established peer failed and the caller has
    /// independent evidence that the peer is gone (its process exited, its
    /// lease expired): see [`TransferError::confirm_disconnect`]. NIXL alone
    /// cannot tell this apart from other backend errors through its C API.
    #[error(
        "peer {peer} disconnected during {op} ({status}); the peer process died or its \
         network went away; reload its metadata after it restarts"
    )]
    PeerDisconnected {
        /// The remote agent name.
        peer: String,
        /// The NIXL operation that failed.
        op: &'static str,
        /// The NIXL status name.
        status: String,
    },

    /// `write` named a peer whose metadata was never loaded (or was forgotten).
    #[error("peer {peer} is not loaded; call load_peer with its metadata first")]
    PeerNotLoaded {
        /// The remote agent name.
        peer: String,
    },

    /// A transfer did not complete in time; the request was released.
    #[error(
        "transfer to {peer} did not complete within {after_ms} ms; the peer may be stopped, \
         overloaded or partitioned; the request was released"
    )]
    Timeout {
        /// The timeout that expired.
        after_ms: u64,
        /// The remote agent name.
        peer: String,
    },

    /// The caller passed something unusable (bad region, out of range, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl TransferError {
    /// The rootrank well-known reason for this error.
    ///
    /// * `"peer_disconnect"` — [`TransferError::PeerDisconnected`].
    /// * `"transfer_timeout"` — [`TransferError::Timeout`].
    /// * `"nixl_error"` — everything NIXL-related else: backend errors, a
    ///   missing or broken library, a peer that is not loaded.
    /// * `"other"` — caller mistakes ([`TransferError::InvalidArgument`]).
    ///
    /// These are the well-known reasons of rootrank-core (`reasons::*`).
    pub fn reason(&self) -> &'static str {
        match self {
            TransferError::PeerDisconnected { .. } => "peer_disconnect",
            TransferError::Timeout { .. } => "transfer_timeout",
            TransferError::InvalidArgument(_) => "other",
            TransferError::LibraryMissing { .. }
            | TransferError::LibraryInvalid { .. }
            | TransferError::Backend { .. }
            | TransferError::PeerNotLoaded { .. } => "nixl_error",
        }
    }

    /// The NIXL status name (e.g. `"NIXL_ERR_BACKEND"`) when NIXL returned one.
    pub fn nixl_status(&self) -> Option<&str> {
        match self {
            TransferError::Backend { status, .. } | TransferError::PeerDisconnected { status, .. } => Some(status),
            _ => None,
        }
    }

    /// Whether this is a backend error from a transfer already posted to a
    /// loaded peer (`post_xfer_req` / `get_xfer_status`): what a dead or
    /// disconnected peer looks like to NIXL's C API.
    pub fn is_transfer_failure(&self) -> bool {
        matches!(
            self,
            TransferError::Backend {
                op: "post_xfer_req" | "get_xfer_status",
                peer: Some(_),
                ..
            }
        )
    }

    /// Upgrades a transfer failure ([`TransferError::is_transfer_failure`])
    /// to [`TransferError::PeerDisconnected`] (reason `peer_disconnect`).
    ///
    /// Call it when something other than NIXL shows the peer is gone: its
    /// process was reaped, its heartbeat or etcd lease expired. NIXL prints
    /// "remote agent ... was disconnected" only to stderr and returns the
    /// same `NIXL_ERR_BACKEND` as for any other backend failure, so this
    /// crate does not guess. Other errors are returned unchanged.
    pub fn confirm_disconnect(self) -> TransferError {
        match self {
            TransferError::Backend {
                op: op @ ("post_xfer_req" | "get_xfer_status"),
                status,
                peer: Some(peer),
                ..
            } => TransferError::PeerDisconnected { peer, op, status },
            other => other,
        }
    }

    pub(crate) fn with_peer(mut self, name: &str) -> Self {
        if let TransferError::Backend { peer, .. } = &mut self {
            *peer = Some(name.to_string());
        }
        self
    }

    pub(crate) fn backend(op: &'static str, err: &NixlError, detail: impl Into<String>) -> Self {
        TransferError::Backend {
            op,
            status: status_name(err).to_string(),
            detail: detail.into(),
            peer: None,
        }
    }
}

/// The NIXL status name that a nixl-sys error stands for.
///
/// nixl-sys folds the C API statuses into [`NixlError`]; this maps them back
/// onto the NIXL names people search logs for.
pub fn status_name(err: &NixlError) -> &'static str {
    match err {
        NixlError::InvalidParam => "NIXL_ERR_INVALID_PARAM",
        NixlError::BackendError => "NIXL_ERR_BACKEND",
        NixlError::NotFound => "NIXL_ERR_NOT_FOUND",
        NixlError::StringConversionError(_) => "NIXL_ERR_INVALID_PARAM",
        NixlError::IndexOutOfBounds => "NIXL_ERR_INVALID_PARAM",
        NixlError::InvalidDataPointer => "NIXL_ERR_INVALID_PARAM",
        NixlError::FailedToCreateXferRequest => "NIXL_ERR_BACKEND",
        NixlError::RegDescListCreationFailed | NixlError::RegDescAddFailed => "NIXL_ERR_BACKEND",
        NixlError::FailedToCreateXferDlistHandle => "NIXL_ERR_BACKEND",
        NixlError::FailedToCreateBackend => "NIXL_ERR_BACKEND",
        NixlError::NoTelemetry => "NIXL_ERR_NO_TELEMETRY",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_and_statuses() {
        let e = TransferError::backend("post_xfer_req", &NixlError::BackendError, "peer p");
        assert_eq!(e.reason(), "nixl_error");
        assert_eq!(e.nixl_status(), Some("NIXL_ERR_BACKEND"));
        assert!(e.to_string().contains("NIXL_ERR_BACKEND"));

        let t = TransferError::Timeout {
            after_ms: 200,
            peer: "p".into(),
        };
        assert_eq!(t.reason(), "transfer_timeout");
        assert_eq!(t.nixl_status(), None);

        assert!(!e.is_transfer_failure(), "no peer, not a transfer");
        let e = e.confirm_disconnect();
        assert_eq!(e.reason(), "nixl_error");

        let x = TransferError::Backend {
            op: "get_xfer_status",
            status: "NIXL_ERR_BACKEND".into(),
            detail: String::new(),
            peer: Some("p".into()),
        };
        assert!(x.is_transfer_failure());
        let d = x.confirm_disconnect();
        assert_eq!(d.reason(), "peer_disconnect");
        assert_eq!(d.nixl_status(), Some("NIXL_ERR_BACKEND"));
        assert!(matches!(d, TransferError::PeerDisconnected { ref peer, .. } if peer == "p"));

        let m = TransferError::LibraryMissing {
            wanted: "libnixl_capi.so".into(),
            searched: "/x".into(),
        };
        assert!(m.to_string().contains("scripts/fetch-nixl.sh"));
        assert_eq!(m.reason(), "nixl_error");
    }
}
