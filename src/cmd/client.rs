//! A small HTTP client for the coordinator's API, shared by `why` and `status`. It takes one
//! URL or several replicas (comma-separated) and tries them in turn: a replica that cannot
//! be reached, drops the connection (killed mid long poll) or is not current (503) hands the
//! question to the next one, within the same overall timeout.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};

/// `--coordinator URL[,URL...]` as base URLs without a trailing slash.
pub fn replica_urls(bases: &str) -> anyhow::Result<Vec<String>> {
    let bases: Vec<String> = bases
        .split(',')
        .map(|b| b.trim().trim_end_matches('/').to_string())
        .filter(|b| !b.is_empty())
        .collect();
    if bases.is_empty() {
        bail!("no coordinator URL: pass --coordinator URL[,URL...] or set ROOTRANK_COORDINATOR");
    }
    Ok(bases)
}

pub struct Api {
    bases: Vec<String>,
    http: reqwest::Client,
    timeout: Duration,
}

impl Api {
    pub fn new(args: &super::CoordinatorArgs, timeout: Duration) -> anyhow::Result<Self> {
        let bases = replica_urls(&args.coordinator)?;
        let http = args.http()?;
        Ok(Api { bases, http, timeout })
    }

    /// GETs `path` from the first replica that answers and returns the JSON body; API errors
    /// (4xx, or 5xx other than 503) become their message.
    pub async fn get(&self, path: &str, query: &[(&str, String)]) -> anyhow::Result<serde_json::Value> {
        let deadline = Instant::now() + self.timeout;
        let mut tried = Vec::new();
        for base in &self.bases {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            let url = format!("{base}{path}");
            let resp = match self.http.get(&url).query(query).timeout(remaining).send().await {
                Ok(r) => r,
                Err(e) => {
                    tried.push(format!("{base}: {e}"));
                    continue;
                }
            };
            let status = resp.status();
            let body: serde_json::Value = match resp.json().await {
                Ok(b) => b,
                Err(e) => {
                    tried.push(format!("{base}: no JSON answer ({e})"));
                    continue;
                }
            };
            let msg = body["error"]["message"].as_str().unwrap_or("unknown error");
            let code = body["error"]["code"].as_str().unwrap_or("error");
            if status.as_u16() == 401 {
                return Err(anyhow!(
                    "{base} wants a bearer token: pass --token-file FILE or set ROOTRANK_TOKEN_FILE ({code}: {msg})"
                ));
            }
            if status.as_u16() == 503 {
                tried.push(format!("{base}: {code}: {msg}"));
                continue;
            }
            if !status.is_success() {
                return Err(anyhow!("{code}: {msg}"));
            }
            return Ok(body);
        }
        Err(anyhow!(
            "cannot reach the coordinator: no replica answered ({}); is `rootrank serve` running? set --coordinator or ROOTRANK_COORDINATOR",
            if tried.is_empty() { "timed out".to_string() } else { tried.join("; ") }
        ))
    }
}
