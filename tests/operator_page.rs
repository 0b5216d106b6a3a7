//! The operator page (`GET /`) in a real browser: headless Chromium from Debian, driven over
//! the DevTools protocol, against a real coordinator and real rank processes. A SIGKILLed
//! rank turns `down` on the open page without a reload, a room lookup shows the culprit, a
//! replica that loses etcd says so, 4,096 ranks render without freezing the page, and at
//! fleet size (12,500 groups, 100,000 ranks) the page pages through `/v1/groups` and draws the
//! groups that matter, with a filter for the others.
//! Screenshots are written to `target/operator-page*.png`.

use std::time::{Duration, Instant};

use rootrank_testkit::{Browser, Coordinator, Etcd, Rank};

fn artifact(name: &str, png: &[u8]) {
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    let dir = rootrank_testkit::repo_root().join("target");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(name);
    std::fs::write(&path, png).unwrap();
    eprintln!("screenshot: {} ({} bytes)", path.display(), png.len());
}

/// The state the page shows for one rank's cell.
fn cell(group: &str, rank: u32) -> String {
    format!(
        r#"(document.querySelector('.group[data-group="{group}"] .cell[data-rank="{rank}"]') || {{dataset: {{}}}}).dataset.state || null"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_a_death_live_and_explains_a_room() {
    let mut etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    let coord = Coordinator::start(&ep, &[]).await.unwrap();
    let mut prefill: Vec<Rank> = (0..4)
        .map(|r| Rank::start(&ep, "prefill-0", r, 4, 1_000).unwrap())
        .collect();
    let _decode: Vec<Rank> = (0..2)
        .map(|r| Rank::start(&ep, "decode-0", r, 2, 1_000).unwrap())
        .collect();
    // A transfer failure rank 1 saw first-hand, and the others' generic error.
    prefill[1]
        .fail(4242, "local", "nixl_error", "NIXL_ERR_BACKEND to decode-0 rank 1")
        .unwrap();
    prefill[0]
        .fail(4242, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();

    let url = coord.url.clone();
    let mut prefill_2 = prefill.remove(2);
    let page = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let mut b = Browser::start(1280, 800)?;
        b.navigate(&url)?;
        b.wait_for(
            "document.querySelectorAll('.group').length === 2",
            Duration::from_secs(20),
            "both groups",
        )?;
        b.wait_for(
            "[...document.querySelectorAll('.cell')].filter(c => c.dataset.state === 'live').length === 6",
            Duration::from_secs(20),
            "six live cells",
        )?;
        assert_eq!(b.eval(&cell("prefill-0", 2))?, "live");
        // A marker a reload would wipe.
        b.eval("window.__still_this_page = 42")?;

        prefill_2.kill9();
        b.wait_for(
            &format!("{} === 'down'", cell("prefill-0", 2)),
            Duration::from_secs(30),
            "rank 2 down",
        )?;
        assert_eq!(b.eval("window.__still_this_page")?, 42, "no reload");
        assert_eq!(b.eval(&cell("prefill-0", 1))?, "live");
        b.wait_for(
            "document.getElementById('summary').textContent.includes('1 rank down in 1 group')",
            Duration::from_secs(10),
            "the count of dead ranks on top",
        )?;

        // The room lookup renders the verdict as `rootrank why` does.
        b.eval("document.getElementById('room').value = '4242'; document.getElementById('lookup').requestSubmit()")?;
        let shown = b.wait_for(
            "document.getElementById('verdict').dataset.status && document.getElementById('verdict').textContent",
            Duration::from_secs(10),
            "the verdict",
        )?;
        let shown = shown.as_str().unwrap_or("").to_string();
        assert!(shown.contains("room 4242: resolved -> abort"), "{shown}");
        assert!(shown.contains("culprit: prefill-0 rank 1"), "{shown}");
        assert!(shown.contains("reason:  nixl_error (from room_record)"), "{shown}");
        // The recent root causes name the culprit with its advice.
        b.wait_for(
            "document.getElementById('failures').textContent.includes('prefill-0 rank 1')",
            Duration::from_secs(10),
            "the root cause listed",
        )?;
        artifact("operator-page.png", &b.screenshot()?);
        Ok(())
    });
    page.await.unwrap().unwrap();

    // A replica that loses etcd says so on the page, and recovers by itself.
    let url = coord.url.clone();
    let mut b = tokio::task::spawn_blocking(move || -> anyhow::Result<Browser> {
        let mut b = Browser::start(1280, 800)?;
        b.navigate(&url)?;
        b.wait_for(
            "document.querySelectorAll('.group').length === 2",
            Duration::from_secs(20),
            "groups",
        )?;
        Ok(b)
    })
    .await
    .unwrap()
    .unwrap();
    etcd.kill();
    let mut b = tokio::task::spawn_blocking(move || -> anyhow::Result<Browser> {
        let shown = b.wait_for(
            "document.getElementById('banner').classList.contains('show') && document.getElementById('banner').textContent",
            Duration::from_secs(60),
            "the not-current banner",
        )?;
        assert!(shown.as_str().unwrap_or("").contains("not current with etcd"), "{shown}");
        Ok(b)
    })
    .await
    .unwrap()
    .unwrap();
    etcd.restart().unwrap();
    tokio::task::spawn_blocking(move || {
        b.wait_for(
            "!document.getElementById('banner').classList.contains('show')",
            Duration::from_secs(60),
            "the banner gone",
        )
    })
    .await
    .unwrap()
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_thousand_ranks_render_without_freezing_the_page() {
    use rootrank_core::records::{RankLive, SCHEMA_VERSION};
    use rootrank_core::{GroupId, Keys};
    use rootrank_store::etcd_client::{PutOptions, Txn, TxnOp};

    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    // 512 groups of 8 live ranks, written straight into etcd on one long lease.
    let mut c = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![ep.clone()]))
        .await
        .unwrap();
    let lease = c.lease_grant(600, None).await.unwrap().id();
    let keys = Keys::new("/rootrank/v1");
    let mut ops = Vec::new();
    for g in 0..512u32 {
        let group = GroupId::new(&format!("{}-{g:03}", if g % 2 == 0 { "prefill" } else { "decode" })).unwrap();
        for r in 0..8u32 {
            let live = RankLive {
                v: SCHEMA_VERSION,
                group: group.clone(),
                rank: r,
                group_size: 8,
                role: Some(if g % 2 == 0 { "prefill" } else { "decode" }.into()),
                host: Some(format!("node-{:03}", g / 4)),
                pid: Some(10_000 + g * 8 + r),
                boot_id: None,
                started_at: None,
                lease_ttl_ms: Some(600_000),
                agent: None,
                nixl_agent: None,
                gpu: None,
                endpoints: Vec::new(),
                pid_ns: None,
                start_ticks: None,
                incarnation: None,
            };
            ops.push(TxnOp::put(
                keys.live(&group, r),
                serde_json::to_vec(&live).unwrap(),
                Some(PutOptions::new().with_lease(lease)),
            ));
        }
    }
    for chunk in ops.chunks(128) {
        c.txn(Txn::new().and_then(chunk.to_vec())).await.unwrap();
    }
    let coord = Coordinator::start(&ep, &[]).await.unwrap();
    // One rank of one group goes down: it must stand out among 4,096.
    c.delete(keys.live(&GroupId::new("decode-301").unwrap(), 5), None)
        .await
        .unwrap();

    let url = coord.url.clone();
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let mut b = Browser::start(1280, 900)?;
        let started = Instant::now();
        b.navigate(&url)?;
        b.wait_for(
            "document.querySelectorAll('.cell').length === 4096",
            Duration::from_secs(60),
            "4,096 cells",
        )?;
        let rendered = started.elapsed();
        b.wait_for(
            &format!("{} === 'down'", cell("decode-301", 5)),
            Duration::from_secs(30),
            "the dead rank",
        )?;
        // The page keeps answering while it polls: a round trip through its event loop.
        let t = Instant::now();
        let v = b.eval("new Promise(r => setTimeout(() => r(document.querySelectorAll('.group.bad').length), 0))")?;
        eprintln!(
            "4,096 ranks: all cells in {rendered:?}; an event-loop round trip {:?} while polling",
            t.elapsed()
        );
        assert_eq!(v, 1, "exactly one group shows a dead rank");
        // The group with the dead rank is listed first.
        assert_eq!(
            b.eval("document.querySelector('#groups .group').dataset.group")?,
            "decode-301"
        );
        artifact("operator-page-4096.png", &b.screenshot()?);
        Ok(())
    })
    .await
    .unwrap()
    .unwrap();
}

/// Fleet size (issue 29): 12,500 groups of 8 live ranks. The page reads the summaries in pages
/// (`/v1/groups?limit=&after=`), counts all 100,000 ranks, draws at most 1,000 groups (the one
/// with the dead rank first), finds any other with its filter, and fetches details only for
/// the groups it draws.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twelve_thousand_five_hundred_groups_are_counted_whole_and_drawn_by_what_matters() {
    use rootrank_core::{GroupId, Keys};
    use rootrank_store::etcd_client::{PutOptions, Txn, TxnOp};

    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    let mut c = rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![ep.clone()]))
        .await
        .unwrap();
    let lease = c.lease_grant(900, None).await.unwrap().id();
    let keys = Keys::new("/rootrank/v1");
    let name = |g: u32| format!("fleet-{g:05}");
    let mut ops = Vec::new();
    for g in 0..12_500u32 {
        let group = GroupId::new(&name(g)).unwrap();
        for r in 0..8u32 {
            let live = serde_json::json!({
                "v": 1, "group": group.as_str(), "rank": r, "group_size": 8, "role": "prefill",
                "host": format!("node-{g:05}"), "pid": 10_000 + r, "lease_ttl_ms": 900_000,
            });
            ops.push(TxnOp::put(
                keys.live(&group, r),
                live.to_string(),
                Some(PutOptions::new().with_lease(lease)),
            ));
        }
    }
    for chunk in ops.chunks(128) {
        c.txn(Txn::new().and_then(chunk.to_vec())).await.unwrap();
    }
    let coord = Coordinator::start(&ep, &[]).await.unwrap();
    rootrank_testkit::eventually(Duration::from_secs(120), "100,000 live ranks", || {
        let coord = &coord;
        async move {
            let (_, h) = coord.get("/v1/groups/fleet-12499").await.ok()?;
            (h["ranks"].as_array()?.len() == 8).then_some(())
        }
    })
    .await
    .unwrap();
    // One rank of a group far down the name order goes down: it must be drawn first.
    c.delete(keys.live(&GroupId::new("fleet-07777").unwrap(), 3), None)
        .await
        .unwrap();

    let url = coord.url.clone();
    let metrics_url = format!("{}/metrics", coord.url);
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let mut b = Browser::start(1280, 900)?;
        let started = Instant::now();
        b.navigate(&url)?;
        b.wait_for(
            "(document.getElementById('summary') || {}).textContent === '1 rank down in 1 group (of 100000 ranks)'",
            Duration::from_secs(120),
            "all 100,000 ranks counted, one down",
        )?;
        b.wait_for(
            &format!("{} === 'down'", cell("fleet-07777", 3)),
            Duration::from_secs(60),
            "the dead rank drawn",
        )?;
        // The 1,000 drawn groups' details, 8,000 cells, and no more.
        b.wait_for(
            "document.querySelectorAll('.cell').length === 8000",
            Duration::from_secs(120),
            "the drawn groups' cells",
        )?;
        let drawn = started.elapsed();
        assert_eq!(
            b.eval("document.querySelector('#groups .group').dataset.group")?,
            "fleet-07777",
            "the group with the dead rank comes first"
        );
        assert_eq!(b.eval("document.querySelectorAll('#groups .group').length")?, 1000);
        assert_eq!(
            b.eval("document.getElementById('shown').textContent")?,
            " showing 1000 of 12500 groups (rank not live first; filter to find others)"
        );
        // The rest are by name: fleet-00000 follows the bad group.
        assert_eq!(
            b.eval("document.querySelectorAll('#groups .group')[1].dataset.group")?,
            "fleet-00000"
        );
        // The filter finds a group that is not drawn.
        b.eval("(() => { const f = document.getElementById('filter'); f.value = 'fleet-12345'; f.dispatchEvent(new Event('input')); return true; })()")?;
        b.wait_for(
            &format!(
                "document.querySelectorAll('#groups .group').length === 1 && [0,1,2,3,4,5,6,7].every(r => {} === 'live')",
                cell("fleet-12345", 0).replace("data-rank=\"0\"", "data-rank=\"' + r + '\"")
            ),
            Duration::from_secs(60),
            "the filtered group, all live",
        )?;
        let t = Instant::now();
        let v = b.eval("new Promise(r => setTimeout(() => r(document.querySelectorAll('.cell').length), 0))")?;
        eprintln!(
            "12,500 groups: counted and the dead rank drawn in {drawn:?}; an event-loop round trip {:?} while polling",
            t.elapsed()
        );
        assert_eq!(v, 8);
        artifact("operator-page-12500.png", &b.screenshot()?);
        Ok(())
    })
    .await
    .unwrap()
    .unwrap();
    // Details were fetched for drawn groups only: 1,000 at first, and each again only when
    // its counts change or after 15 s (this test is shorter); never the 12,500.
    let text = rootrank_testkit::scrape_metrics(metrics_url.trim_start_matches("http://").trim_end_matches("/metrics"))
        .await
        .unwrap();
    let details: f64 = text
        .lines()
        .filter(|l| {
            l.starts_with("rootrank_http_request_duration_seconds_count{") && l.contains("route=\"/v1/groups/{group}\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    eprintln!("group details fetched by the page: {details}");
    assert!((1000.0..3000.0).contains(&details), "{details} group details fetched");
}

/// A coordinator that wants a bearer token: the page asks for it once (no data before), keeps
/// it for the tab, and then shows the groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_asks_for_the_token_once_then_shows_the_groups() {
    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "page-t0ken\n").unwrap();
    let token_arg = token.display().to_string();
    let coord = Coordinator::start(&ep, &["--auth-token-file", &token_arg])
        .await
        .unwrap();
    let _ranks: Vec<Rank> = (0..2)
        .map(|r| Rank::start(&ep, "tok-0", r, 2, 1_000).unwrap())
        .collect();
    let url = coord.url.clone();
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let mut b = Browser::start(1280, 800)?;
        b.navigate(&url)?;
        b.wait_for(
            "(document.getElementById('auth') || {hidden: true}).hidden === false",
            Duration::from_secs(20),
            "the token form",
        )?;
        assert_eq!(
            b.eval("document.querySelectorAll('.group').length")?,
            0,
            "no data without the token"
        );
        // A wrong token is refused and asked for again.
        b.eval("document.getElementById('token').value = 'wrong'; document.getElementById('auth').requestSubmit(); 1")?;
        b.wait_for(
            "document.getElementById('auth-error').textContent.includes('refused')",
            Duration::from_secs(20),
            "the refusal",
        )?;
        b.eval(
            "document.getElementById('token').value = 'page-t0ken'; document.getElementById('auth').requestSubmit(); 1",
        )?;
        b.wait_for(
            "[...document.querySelectorAll('.cell')].filter(c => c.dataset.state === 'live').length === 2",
            Duration::from_secs(20),
            "the group's two live ranks",
        )?;
        assert_eq!(b.eval("document.getElementById('auth').hidden")?, true);
        assert_eq!(b.eval("sessionStorage.getItem('rootrank-token')")?, "page-t0ken");
        artifact("operator-page-token.png", &b.screenshot()?);
        Ok(())
    })
    .await
    .unwrap()
    .unwrap();
}
