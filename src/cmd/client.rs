//! A small HTTP client for the coordinator's API, shared by `why` and `status`.

use std::time::Duration;

use anyhow::{anyhow, Context};

pub struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    pub fn new(base: &str, timeout: Duration) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder().timeout(timeout).build()?;
        Ok(Api {
            base: base.trim_end_matches('/').to_string(),
            http,
        })
    }

    /// GETs `path` and returns the JSON body; API errors become their message.
    pub async fn get(&self, path: &str, query: &[(&str, String)]) -> anyhow::Result<serde_json::Value> {
        let url = format!("{}{}", self.base, path);
        let resp = self
            .http
            .get(&url)
            .query(query)
            .send()
            .await
            .with_context(|| format!("cannot reach the coordinator at {} (is `rootrank serve` running? set --coordinator or ROOTRANK_COORDINATOR)", self.base))?;
        let status = resp.status();
        let body: serde_json::Value = resp
            .json()
            .await
            .with_context(|| format!("the coordinator at {} sent a non-JSON answer", self.base))?;
        if !status.is_success() {
            let msg = body["error"]["message"].as_str().unwrap_or("unknown error");
            let code = body["error"]["code"].as_str().unwrap_or("error");
            return Err(anyhow!("{code}: {msg}"));
        }
        Ok(body)
    }
}
