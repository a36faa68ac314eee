//! The console in a real browser: headless Debian Chromium driven over the
//! WebDriver protocol (`chromedriver`), with reqwest as the client.
//!
//! Two replicas share one embedded store in this process (two `App`s over one `MemoryLog`:
//! the embedded store cannot be shared between processes). The page is loaded from replica
//! A; the test deposits through the page, sees the balance move through the watch stream,
//! sends the same key again and sees the replay mark, changes the amount under that key and
//! sees the 422, writes through replica B and sees that write appear, checks the page made
//! no request to anywhere but A (a recording proxy catches anything else), checks labels
//! and phone width, and saves a screenshot (docs/console.png, which
//! docs/console-and-watch.md shows, when `TALLY_UPDATE_SCREENSHOT=1`).
//!
//! Skipped (and passing) when `chromedriver` is not installed, unless
//! `TALLY_REQUIRE_BROWSER=1` (set by `make test`, which installs it).

use crate::common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestApp, new_account, spawn_fleet, test_auth};
use serde_json::{Value, json};
use tally::store::SharedLog;
use tally::store::memory::MemoryLog;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

/// How long the page may take to show what a step waits for.
const UI_BOUND: Duration = Duration::from_secs(15);
/// How long a refused stream is watched for a retry it must not make (the console used to
/// retry every second).
const NO_RETRY_WATCH: Duration = Duration::from_millis(2_500);
/// How long chromedriver may take to start.
const DRIVER_START_BOUND: Duration = Duration::from_secs(20);
/// The WebDriver key of an element reference.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";
/// Where the docs' screenshot lives: rewritten only when `TALLY_UPDATE_SCREENSHOT=1`, so
/// an ordinary test run leaves the checkout clean (ports and ids differ from run to run).
const SCREENSHOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/console.png");

/// Where this run's screenshot goes: the docs' when asked, else the temp directory.
fn screenshot_path() -> std::path::PathBuf {
    if std::env::var("TALLY_UPDATE_SCREENSHOT").as_deref() == Ok("1") {
        SCREENSHOT.into()
    } else {
        std::env::temp_dir().join(format!("tally-console-{}.png", std::process::id()))
    }
}

fn chromium_paths() -> Option<(String, String)> {
    let driver = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into());
    let browser = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    (std::path::Path::new(&driver).exists() && std::path::Path::new(&browser).exists())
        .then_some((driver, browser))
}

/// A chromedriver process and one browser session on it.
struct Browser {
    driver: Child,
    http: reqwest::Client,
    session: String,
    /// The session was ended by `close`.
    closed: bool,
}

impl Browser {
    async fn start(driver: &str, browser: &str, proxy_port: u16) -> Browser {
        let port = free_port();
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver starts");
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = tokio::time::Instant::now() + DRIVER_START_BOUND;
        loop {
            if let Ok(r) = http.get(format!("{base}/status")).send().await
                && r.status().is_success()
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "chromedriver did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            // The DevTools network log of the page: every request it makes, and only its own.
            "goog:loggingPrefs": {"performance": "ALL"},
            "goog:chromeOptions": {
                "binary": browser,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--window-size=1280,1000", "--hide-scrollbars", "--force-color-profile=srgb",
                    // Nothing leaves the machine: anything not on loopback goes to a proxy
                    // that answers nothing (the browser's own update and time checks, too);
                    // loopback (the replicas) bypasses it, as Chromium does by default.
                    format!("--proxy-server=http://127.0.0.1:{proxy_port}"),
                    // The browser's own background traffic is not the page's: switch it off.
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--disable-default-apps", "--disable-extensions",
                    "--no-first-run", "--no-default-browser-check", "--metrics-recording-only",
                    "--disable-client-side-phishing-detection", "--disable-domain-reliability",
                ],
            },
        }}});
        let r: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .expect("new session")
            .json()
            .await
            .expect("session JSON");
        let id = r["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {r}"))
            .to_string();
        Browser {
            driver: child,
            http,
            session: format!("{base}/session/{id}"),
            closed: false,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self.http.request(method, format!("{}{path}", self.session));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r: Value = req
            .send()
            .await
            .expect("webdriver call")
            .json()
            .await
            .expect("JSON");
        if r["value"].get("error").is_some() {
            panic!("webdriver {path}: {r}");
        }
        r["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    async fn js(&self, script: &str) -> Value {
        self.call(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({ "script": script, "args": [] })),
        )
        .await
    }

    /// Waits until `script` (an expression) is truthy; returns its value.
    async fn until(&self, what: &str, script: &str) -> Value {
        let deadline = tokio::time::Instant::now() + UI_BOUND;
        loop {
            let v = self.js(&format!("return ({script});")).await;
            if !(v.is_null() || v == json!(false) || v == json!("")) {
                return v;
            }
            if tokio::time::Instant::now() > deadline {
                let page = self.js("return document.body.innerText").await;
                panic!("timed out waiting for {what}; page text:\n{page}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn element(&self, css: &str) -> String {
        let v = self
            .call(
                reqwest::Method::POST,
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v[ELEMENT_KEY].as_str().expect("element id").to_string()
    }

    async fn click(&self, css: &str) {
        let e = self.element(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{e}/click"),
            Some(json!({})),
        )
        .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let e = self.element(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{e}/clear"),
            Some(json!({})),
        )
        .await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{e}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// The URLs of every request the page made, from the DevTools network log.
    async fn page_requests(&self) -> Vec<String> {
        let entries = self
            .call(
                reqwest::Method::POST,
                "/se/log",
                Some(json!({"type": "performance"})),
            )
            .await;
        let mut urls = Vec::new();
        for e in entries.as_array().cloned().unwrap_or_default() {
            let Some(text) = e["message"].as_str() else {
                continue;
            };
            let m: Value = serde_json::from_str(text).unwrap_or(Value::Null);
            if m["message"]["method"] == "Network.requestWillBeSent"
                && let Some(url) = m["message"]["params"]["request"]["url"].as_str()
            {
                urls.push(url.to_string());
            }
        }
        urls
    }

    async fn resize(&self, width: u32, height: u32) {
        self.call(
            reqwest::Method::POST,
            "/window/rect",
            Some(json!({"width": width, "height": height})),
        )
        .await;
    }

    async fn screenshot(&self) -> Vec<u8> {
        let v = self.call(reqwest::Method::GET, "/screenshot", None).await;
        base64_decode(v.as_str().expect("base64 PNG"))
    }

    async fn close(mut self) {
        let _ = self.http.delete(&self.session).send().await;
        self.closed = true;
        let _ = self.driver.kill().await;
    }
}

impl Drop for Browser {
    /// A test that fails before `close` must not leave its browser running: killing
    /// chromedriver alone orphans Chromium, so end the session first (a blocking request,
    /// bounded, since Drop cannot await).
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        use std::io::{Read, Write};
        let Some(rest) = self.session.strip_prefix("http://") else {
            return;
        };
        let Some((host, path)) = rest.split_once('/') else {
            return;
        };
        if let Ok(mut conn) = std::net::TcpStream::connect(host) {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
            let request = format!(
                "DELETE /{path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            if conn.write_all(request.as_bytes()).is_ok() {
                let mut reply = Vec::new();
                let _ = conn.read_to_end(&mut reply);
            }
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A proxy that answers nothing and records the first line of every request sent to it
/// (anything the browser sends off loopback, its own background checks included).
async fn recording_proxy() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let n = conn.read(&mut buf).await.unwrap_or(0);
                let line = String::from_utf8_lossy(&buf[..n]);
                // The request line and any Referer: enough to tell who sent it.
                let kept: Vec<&str> = line
                    .lines()
                    .filter(|l| {
                        !l.contains(' ')
                            || l.starts_with("GET")
                            || l.starts_with("POST")
                            || l.starts_with("CONNECT")
                            || l.to_ascii_lowercase().starts_with("referer")
                    })
                    .collect();
                record.lock().unwrap().push(kept.join(" | "));
            });
        }
    });
    (port, seen)
}

/// Standard base64 (what WebDriver's screenshot returns).
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a' + 26) as u32,
            b'0'..=b'9' => (c - b'0' + 52) as u32,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for chunk in bytes.chunks(4) {
        let pad = chunk.iter().filter(|&&c| c == b'=').count();
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= if c == b'=' { 0 } else { val(c) } << (18 - 6 * i);
        }
        let three = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&three[..3 - pad]);
    }
    out
}

/// chromedriver and Chromium, or `None` (the test is skipped, and says so) when they are not
/// installed; `TALLY_REQUIRE_BROWSER` (set by `make test`) turns that into a failure.
fn browser_or_skip() -> Option<(String, String)> {
    let found = chromium_paths();
    if found.is_none() {
        common::required::skip_or_fail(
            "chromedriver or chromium not installed",
            "make test installs them",
            std::env::var("TALLY_REQUIRE_BROWSER").is_ok(),
        );
    }
    found
}

async fn deposit(t: &TestApp, account: &str, cents: i64) {
    let r = t.deposit(account, cents, None).await;
    assert_eq!(r.status, reqwest::StatusCode::OK, "{}", r.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_live_balances_replays_and_other_replicas_writes_in_a_browser() {
    let Some((driver, chromium)) = browser_or_skip() else {
        return;
    };
    // Replica A runs with --faults and no fault probabilities: the faults panel shows, and
    // nothing is actually injected.
    let store: SharedLog = Arc::new(MemoryLog::new());
    let mut fleet = spawn_fleet(2, store, &["--faults", "seed=16"]).await;
    let (b, a) = (fleet.pop().unwrap(), fleet.pop().unwrap());
    let (alice, bob) = (new_account(), new_account());
    deposit(&a, &alice, 1_000).await;
    deposit(&a, &bob, 500).await;

    let (proxy_port, proxied) = recording_proxy().await;
    let br = Browser::start(&driver, &chromium, proxy_port).await;
    let origin = format!("http://{}", a.addr);
    br.goto(&format!("{origin}/#{alice},{bob}")).await;
    let card = format!(r#"document.querySelector('[data-account="{alice}"]')"#);
    let balance = format!("{card}?.querySelector('.balance')");
    br.until(
        "alice's snapshot",
        &format!("{balance}?.dataset.version === '1'"),
    )
    .await;
    br.until(
        "the stream to be live",
        &format!("{card}.querySelector('.live.on')"),
    )
    .await;
    assert_eq!(
        br.js(&format!("return {balance}.dataset.cents")).await,
        "1000"
    );

    // Deposit through the page: the answer shows its key; the balance moves by the stream
    // (the page never takes a balance from a write's answer).
    br.type_into("#w-amount", "250").await;
    let key = br
        .js("return document.getElementById('w-key').textContent")
        .await;
    br.click("#send").await;
    br.until(
        "the answer",
        "document.getElementById('result-status').textContent === '200'",
    )
    .await;
    assert_eq!(
        br.js("return document.getElementById('result-replayed').textContent")
            .await,
        "false"
    );
    assert_eq!(
        br.js("return document.getElementById('result-key').textContent")
            .await,
        key
    );
    br.until(
        "the balance after the deposit",
        &format!("{balance}.dataset.cents === '1250' && {balance}.dataset.version === '2'"),
    )
    .await;
    // Shown in the unit the form takes, and saying so: cents, never 12.50 beside a form
    // that took 250 for 2.50.
    assert_eq!(
        br.js("return document.querySelector('label[for=w-amount]').textContent")
            .await,
        "Amount (cents)"
    );
    assert_eq!(
        br.js(&format!("return {balance}.textContent")).await,
        "1,250 cents"
    );
    br.until(
        "the deposit in the history, in cents",
        &format!(
            "[...{card}.querySelectorAll('.history li')].some(li => li.textContent.includes('Deposited +250 cents → 1,250 cents'))"
        ),
    )
    .await;

    // The same key again: answered from the first request, marked as a replay, not written.
    br.click("#resend").await;
    br.until(
        "the replay mark",
        "document.getElementById('result-replayed').textContent === 'true'",
    )
    .await;
    assert_eq!(
        br.js("return document.getElementById('result-status').textContent")
            .await,
        "200"
    );
    // A changed amount under the same key: the 422 reuse answer, with its code and message.
    br.type_into("#w-amount", "300").await;
    br.click("#resend").await;
    br.until(
        "the 422",
        "document.getElementById('result-status').textContent === '422'",
    )
    .await;
    assert_eq!(
        br.js("return document.getElementById('result-code').textContent")
            .await,
        "IDEMPOTENCY_KEY_REUSED"
    );
    assert_ne!(
        br.js("return document.getElementById('result-message').textContent")
            .await,
        ""
    );
    assert_eq!(a.balance(&alice).await, (1_250, 2), "neither resend wrote");

    // A write through the other replica appears on this page.
    deposit(&b, &alice, 50).await;
    br.until(
        "replica B's write",
        &format!("{balance}.dataset.cents === '1300' && {balance}.dataset.version === '3'"),
    )
    .await;
    br.until(
        "its history entry",
        &format!("{card}.querySelector('li[data-version=\"3\"]')"),
    )
    .await;

    // A transfer through the page moves both cards.
    br.click(r#"input[name="op"][value="transfer"]"#).await;
    br.js(&format!("const s = document.getElementById('w-to'); s.value = '{bob}'; s.dispatchEvent(new Event('change')); return true"))
        .await;
    br.click("#new-key").await;
    br.type_into("#w-amount", "100").await;
    br.click("#send").await;
    let bob_balance = format!(r#"document.querySelector('[data-account="{bob}"] .balance')"#);
    br.until(
        "bob's credit",
        &format!("{bob_balance}.dataset.cents === '600'"),
    )
    .await;
    br.until(
        "alice's debit",
        &format!("{balance}.dataset.cents === '1200'"),
    )
    .await;

    // The faults panel reads /metrics live.
    br.until("the faults panel", "!document.getElementById('faults').hidden && Number(document.querySelector('tr[data-arm=\"success\"] td')?.textContent) >= 2")
        .await;

    // Accessible: every control has a label; usable at phone width without sideways scroll.
    let unlabelled = br
        .js("return Array.from(document.querySelectorAll('input, select')).filter(e => e.labels.length === 0).map(e => e.outerHTML)")
        .await;
    assert_eq!(unlabelled, json!([]), "controls without a label");
    // The whole page, faults panel included.
    let height = br.js("return document.documentElement.scrollHeight").await;
    br.resize(
        1280,
        height.as_u64().unwrap_or(1000).clamp(800, 2400) as u32 + 100,
    )
    .await;
    let png = br.screenshot().await;
    assert!(
        png.starts_with(b"\x89PNG"),
        "the screenshot is a PNG ({} bytes)",
        png.len()
    );
    let path = screenshot_path();
    std::fs::write(&path, png).expect("screenshot written");
    println!("screenshot: {}", path.display());
    br.resize(390, 844).await;
    br.until(
        "the phone-width layout",
        "document.documentElement.clientWidth <= 400",
    )
    .await;
    let overflow = br
        .js("return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        .await;
    assert_eq!(overflow, json!(0), "horizontal overflow at phone width");

    // The page made no request to anywhere but this replica: the DevTools log of its
    // requests (the document, scripts, fetches and event streams) names only this origin,
    // and no request the proxy caught came from the page (it names the origin as Referer).
    let requests = br.page_requests().await;
    assert!(
        requests.iter().any(|u| u.contains("/events")),
        "{requests:?}"
    );
    let foreign: Vec<_> = requests
        .iter()
        .filter(|u| !u.starts_with(&format!("{origin}/")))
        .collect();
    assert!(
        foreign.is_empty(),
        "requests to another origin: {foreign:?}"
    );
    let from_page: Vec<String> = proxied
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.contains(&a.addr.to_string()))
        .cloned()
        .collect();
    assert!(
        from_page.is_empty(),
        "page requests that left loopback: {from_page:?}"
    );

    br.close().await;
    a.shutdown().await;
    b.shutdown().await;
}

/// Rule: against a replica run with `--auth jwt` the console works with a pasted token: it
/// is refused (401 shown, nothing written) without one, and with one it lists, watches live
/// (the stream read with the token, since `EventSource` cannot send it) and writes. A stream
/// the token may not read is shown refused, with its status, and not asked for again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_auth_on_the_console_reads_streams_and_writes_with_a_pasted_token() {
    let Some((driver, chromium)) = browser_or_skip() else {
        return;
    };
    let secret = test_auth::secret_file();
    let store: SharedLog = Arc::new(MemoryLog::new());
    let a = spawn_fleet(1, store, &test_auth::flags(&secret))
        .await
        .pop()
        .expect("a replica");
    let token = test_auth::token(json!({}));
    let alice = new_account();
    let client = reqwest::Client::new();
    let deposit_with_token = |cents: i64| {
        client
            .post(format!("http://{}/api/accounts/{alice}/deposit", a.addr))
            .bearer_auth(&token)
            .header("Idempotency-Key", uuid::Uuid::new_v4().to_string())
            .json(&json!({ "amountCents": cents }))
            .send()
    };
    assert_eq!(deposit_with_token(1_000).await.unwrap().status(), 200);

    let (proxy_port, _) = recording_proxy().await;
    let br = Browser::start(&driver, &chromium, proxy_port).await;
    let origin = format!("http://{}", a.addr);
    br.goto(&format!("{origin}/#{alice}")).await;
    // No token: the account list and the card's stream say they were refused, and why.
    br.until(
        "the account list's refusal",
        "document.getElementById('accounts-error').textContent.includes('HTTP 401')",
    )
    .await;
    let card = format!(r#"document.querySelector('[data-account="{alice}"]')"#);
    let badge = format!("{card}?.querySelector('.live')");
    br.until(
        "the card's refused stream",
        &format!("{badge}?.textContent === 'refused: HTTP 401'"),
    )
    .await;
    // No token: the write is refused with the auth error shown, and nothing is written.
    br.type_into("#w-amount", "5").await;
    br.click("#send").await;
    br.until(
        "the refusal",
        "document.getElementById('result-status').textContent === '401'",
    )
    .await;
    assert_eq!(
        br.js("return document.getElementById('result-code').textContent")
            .await,
        "UNAUTHORIZED"
    );

    br.type_into("#token", &token).await;
    br.click("#token-form button").await;
    let balance = format!("{card}?.querySelector('.balance')");
    br.until(
        "alice's snapshot over the token-carrying stream",
        &format!("{balance}?.dataset.version === '1' && {balance}.dataset.cents === '1000'"),
    )
    .await;
    // Another writer's deposit arrives by the stream.
    assert_eq!(deposit_with_token(250).await.unwrap().status(), 200);
    br.until(
        "the live deposit",
        &format!("{balance}.dataset.cents === '1250' && {balance}.dataset.version === '2'"),
    )
    .await;
    // And the page's own write goes through with the token.
    br.type_into("#w-amount", "50").await;
    br.click("#send").await;
    br.until(
        "the write's answer",
        "document.getElementById('result-status').textContent === '200'",
    )
    .await;
    br.until(
        "the page's own deposit on the stream",
        &format!("{balance}.dataset.cents === '1300' && {balance}.dataset.version === '3'"),
    )
    .await;
    assert_eq!(
        br.js("return document.getElementById('accounts-error').textContent")
            .await,
        "",
        "with the token the list is served"
    );

    // A token for another account only: alice's stream is forbidden, said once, not retried.
    let other = test_auth::token(json!({ "accounts": [new_account()] }));
    let listed = client
        .get(format!("{origin}/api/accounts"))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap()["accounts"]
        .as_array()
        .map_or(0, Vec::len);
    br.js("document.getElementById('token').value = ''").await;
    br.type_into("#token", &other).await;
    br.click("#token-form button").await;
    br.until(
        "every card's stream refused",
        &format!(
            "(() => {{ const b = [...document.querySelectorAll('.card .live')]; \
             return b.length === {} && b.every((x) => x.textContent === 'refused: HTTP 403'); }})()",
            listed + 1
        ),
    )
    .await;
    let detail = br
        .js(&format!(
            "return {card}.querySelector('.refusal').textContent"
        ))
        .await;
    assert!(
        detail.as_str().is_some_and(|d| d.contains("FORBIDDEN")),
        "{detail}"
    );
    let forbidden = || async {
        let text = client
            .get(format!("{origin}/metrics"))
            .send()
            .await
            .expect("scraped")
            .text()
            .await
            .expect("read");
        common::metric_sum(&text, r#"tally_auth_requests_total{outcome="forbidden"}"#)
    };
    let refused = forbidden().await;
    assert_eq!(refused, (listed + 1) as f64, "one refusal per card");
    // Nothing can signal a request that is never made: watch for longer than the former
    // retry loop's second between tries.
    tokio::time::sleep(NO_RETRY_WATCH).await;
    assert_eq!(
        forbidden().await,
        refused,
        "a refused stream was asked for again"
    );
    br.close().await;
    a.shutdown().await;
}
