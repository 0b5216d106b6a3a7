//! Headless Chromium (Debian's `chromium`), driven over the DevTools protocol: navigate,
//! evaluate JavaScript, take a screenshot. Enough to test the operator page as a user sees it.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use base64::Engine;
use serde_json::{json, Value};
use tungstenite::{stream::MaybeTlsStream, Message, WebSocket};

/// Chromium's whole process tree: it forks zygotes and renderers that would outlive the
/// main process (and keep inherited file descriptors, such as a build lock, open).
struct Tree(Child);

impl Drop for Tree {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the process group this child leads (spawned with process_group(0)).
        unsafe {
            libc::kill(-(self.0.id() as i32), libc::SIGKILL);
        }
        let _ = self.0.wait();
    }
}

/// A headless Chromium with one page. Killed (all its processes) on drop.
pub struct Browser {
    _tree: Tree,
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
    next_id: u64,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// The `chromium` binary, installing it (scripts/deps.sh) when it is missing.
    pub fn binary() -> anyhow::Result<std::path::PathBuf> {
        let find = || {
            ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
                .into_iter()
                .map(std::path::PathBuf::from)
                .find(|p| p.is_file())
        };
        if let Some(p) = find() {
            return Ok(p);
        }
        let deps = crate::repo_root().join("scripts/deps.sh");
        let ok = Command::new("bash")
            .arg(&deps)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        match find() {
            Some(p) => Ok(p),
            None => bail!(
                "chromium is not installed and {} could not install it (ok={ok})",
                deps.display()
            ),
        }
    }

    /// Starts Chromium headless with a `width` x `height` window on `about:blank`.
    pub fn start(width: u32, height: u32) -> anyhow::Result<Browser> {
        let profile = tempfile::tempdir()?;
        use std::os::unix::process::CommandExt;
        let mut child = Command::new(Self::binary()?)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                &format!("--window-size={width},{height}"),
                &format!("--user-data-dir={}", profile.path().display()),
                "about:blank",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .context("starting chromium")?;
        // Chromium says where its DevTools endpoint is on stderr.
        let stderr = child.stderr.take().ok_or_else(|| anyhow!("no stderr"))?;
        let tree = Tree(child);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(url) = line.split("DevTools listening on ").nth(1) {
                    let _ = tx.send(url.trim().to_string());
                }
            }
        });
        let browser_ws = rx
            .recv_timeout(Duration::from_secs(30))
            .context("chromium did not print its DevTools address in 30 s")?;
        let port = browser_ws
            .trim_start_matches("ws://")
            .split(['/', ':'])
            .nth(1)
            .and_then(|p| p.parse::<u16>().ok())
            .ok_or_else(|| anyhow!("unexpected DevTools address {browser_ws}"))?;
        let page_ws = page_websocket(port)?;
        let (ws, _) = tungstenite::connect(page_ws.as_str()).context("connecting to the page")?;
        // A hung browser fails the test instead of hanging it.
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_secs(60)))?;
        }
        Ok(Browser {
            _tree: tree,
            ws,
            next_id: 1,
            _profile: profile,
        })
    }

    /// One DevTools command; returns its `result`.
    pub fn call(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        self.ws.send(Message::text(
            json!({"id": id, "method": method, "params": params}).to_string(),
        ))?;
        loop {
            let msg = self.ws.read()?;
            let Message::Text(text) = msg else { continue };
            let v: Value = serde_json::from_str(text.as_str())?;
            if v["id"] == id {
                if let Some(e) = v.get("error") {
                    bail!("{method}: {e}");
                }
                return Ok(v["result"].clone());
            }
        }
    }

    pub fn navigate(&mut self, url: &str) -> anyhow::Result<()> {
        self.call("Page.navigate", json!({"url": url}))?;
        Ok(())
    }

    /// Evaluates `expression` in the page (awaiting a promise) and returns its value.
    pub fn eval(&mut self, expression: &str) -> anyhow::Result<Value> {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        )?;
        if let Some(e) = r.get("exceptionDetails") {
            bail!("{expression}: {e}");
        }
        Ok(r["result"]["value"].clone())
    }

    /// Evaluates `expression` every 100 ms until it returns something truthy (that value).
    pub fn wait_for(&mut self, expression: &str, timeout: Duration, what: &str) -> anyhow::Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.eval(expression)?;
            let truthy = !matches!(&v, Value::Null | Value::Bool(false)) && v != json!("") && v != json!(0);
            if truthy {
                return Ok(v);
            }
            if Instant::now() > deadline {
                bail!("timed out after {timeout:?} waiting for {what} (last: {v})");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A PNG of the page as it is now.
    pub fn screenshot(&mut self) -> anyhow::Result<Vec<u8>> {
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}))?;
        let data = r["data"].as_str().ok_or_else(|| anyhow!("no screenshot data"))?;
        Ok(base64::engine::general_purpose::STANDARD.decode(data)?)
    }
}

fn page_websocket(port: u16) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list: Option<Value> = (|| {
            // Chromium keeps the connection open (no Connection: close): read by Content-Length.
            use std::io::{Read, Write};
            let s = TcpStream::connect(("127.0.0.1", port)).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            let mut w = s.try_clone().ok()?;
            write!(w, "GET /json/list HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").ok()?;
            let mut r = BufReader::new(s);
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                r.read_line(&mut line).ok()?;
                let line = line.trim_end();
                if line.is_empty() {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().ok()?;
                }
            }
            let mut body = vec![0u8; len];
            r.read_exact(&mut body).ok()?;
            serde_json::from_slice(&body).ok()
        })();
        if let Some(url) = list.as_ref().and_then(|l| {
            l.as_array()?.iter().find(|t| t["type"] == "page")?["webSocketDebuggerUrl"]
                .as_str()
                .map(str::to_string)
        }) {
            return Ok(url);
        }
        if Instant::now() > deadline {
            bail!("no page target on chromium's DevTools port {port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.ws.close(None);
    }
}
