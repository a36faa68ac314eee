//! `deploy/fleet.sh` on the embedded store, as `make fleet` runs it: real `tally` replicas
//! behind a real nginx, no Celeriant needed.
//!
//! - A fleet exists to survive a replica's death: the script names the replica that died,
//!   nginx keeps answering through the others, and the replica is started again, at most
//!   `FLEET_MAX_RESTARTS` times; past that it stays down and the others go on serving.
//! - The fleet and a replica started by hand are one writer: both take the binary's default
//!   client id, so on one store neither shows the other's deposits as a foreign client's.
//!
//! Every wait is on what the script prints or a port answering, never a fixed sleep.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::fleet_script::{Fleet, FleetStore, Stream, signal};
use reqwest::StatusCode;
use tally::account::{Identity, named_id};

/// Replicas in the fleet.
const FLEET_SIZE: u16 = 3;
/// Restarts each replica gets (`FLEET_MAX_RESTARTS`): one, so the second death is final.
const MAX_RESTARTS: &str = "1";
/// fleet.sh stops by itself after this long, should this test die without stopping it.
const FLEET_MAX_SECONDS: &str = "150";
/// How long the script may take to say a replica died, and to bring one back (its restart
/// pause is 1 s, and a replica's start-up well under its own 30 s bound).
const NOTICE_BOUND: Duration = Duration::from_secs(40);
/// Any one HTTP exchange.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Requests sent through nginx while a replica is down.
const REQUESTS_WHILE_DOWN: usize = 20;

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .no_proxy()
        .build()
        .expect("client")
}

/// `GET path` on `base`: the status and the replica nginx named last in `X-Tally-Upstream`
/// (it names every one it tried, the one that answered last).
async fn get(client: &reqwest::Client, base: &str, path: &str) -> (StatusCode, String) {
    let r = client
        .get(format!("{base}{path}"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {base}{path}: {e}"));
    let upstream = r
        .headers()
        .get("x-tally-upstream")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.rsplit(", ").next())
        .unwrap_or("")
        .to_owned();
    (r.status(), upstream)
}

/// Rule: one replica's death does not stop the fleet. The script names the replica, nginx
/// keeps answering through the others, the replica comes back on its port under a new pid;
/// once it has used its restarts it stays down, the others still serve, and the script's
/// exit status says a replica was lost.
#[test]
fn a_dead_replica_is_named_and_restarted_within_its_bound_while_the_others_serve() {
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    let client = client();
    let mut fleet = Fleet::start(
        &FleetStore::Memory,
        FLEET_SIZE,
        &[
            ("FLEET_MAX_RESTARTS", MAX_RESTARTS),
            ("FLEET_MAX_SECONDS", FLEET_MAX_SECONDS),
        ],
    );
    // The replica nginx sends Alice's requests to: its death is the one a caller would see.
    let alice = format!(
        "/api/accounts/{}/balance",
        tally::config::demo_account_id("Alice")
    );
    let (status, home) = rt.block_on(get(&client, &fleet.lb, &alice));
    assert_eq!(status, StatusCode::OK);
    let victim = fleet
        .replicas
        .iter()
        .position(|r| r.trim_start_matches("http://") == home)
        .unwrap_or_else(|| panic!("X-Tally-Upstream {home:?} is not a replica"));
    let port = home.rsplit(':').next().unwrap().to_owned();

    // First death: named, with its port and pid, and a restart announced.
    let first_pid = fleet.replica_pids[victim];
    signal("TERM", first_pid);
    let died = format!("replica {victim} on port {port} (pid {first_pid}) exited");
    let notice = fleet
        .wait_line(NOTICE_BOUND, |s, l| {
            s == Stream::Stderr && l.contains(&died)
        })
        .unwrap_or_else(|| panic!("no {died:?} notice; stderr:\n{}", fleet.stderr()));
    assert!(
        notice.contains("the others keep serving") && notice.contains("restart 1 of 1"),
        "{notice}"
    );
    rt.block_on(async {
        for _ in 0..REQUESTS_WHILE_DOWN {
            let (status, _) = get(&client, &fleet.lb, &alice).await;
            assert_eq!(
                status,
                StatusCode::OK,
                "nginx answers while a replica is down"
            );
        }
    });
    let back = format!("replica {victim} on 127.0.0.1:{port} is back: pid ");
    fleet
        .wait_line(NOTICE_BOUND, |s, l| {
            s == Stream::Stdout && l.starts_with(&back)
        })
        .unwrap_or_else(|| panic!("replica {victim} not back; stdout:\n{:?}", fleet.stdout));
    let second_pid = fleet.replica_pids[victim];
    assert_ne!(
        second_pid, first_pid,
        "the restarted replica is a new process"
    );
    let (status, _) = rt.block_on(get(&client, &fleet.replicas[victim], "/healthz"));
    assert_eq!(
        status,
        StatusCode::OK,
        "the restarted replica answers on its port"
    );

    // Second death: past FLEET_MAX_RESTARTS, it stays down; the fleet goes on without it.
    signal("KILL", second_pid);
    let final_notice = format!("replica {victim} on port {port} (pid {second_pid}) was killed");
    let notice = fleet
        .wait_line(NOTICE_BOUND, |s, l| {
            s == Stream::Stderr && l.contains(&final_notice)
        })
        .unwrap_or_else(|| panic!("no {final_notice:?} notice; stderr:\n{}", fleet.stderr()));
    assert!(notice.contains("stays down"), "{notice}");
    fleet
        .wait_line(NOTICE_BOUND, |s, l| {
            s == Stream::Stdout && l.starts_with("2 of 3 replicas still serve")
        })
        .expect("the script says how many replicas still serve");
    rt.block_on(async {
        for _ in 0..REQUESTS_WHILE_DOWN {
            let (status, upstream) = get(&client, &fleet.lb, &alice).await;
            assert_eq!(status, StatusCode::OK, "the others serve Alice");
            assert_ne!(upstream, home, "answered by another replica");
        }
    });
    assert!(fleet.running(), "fleet.sh goes on with the replicas left");
    let status = fleet.stop();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(1),
        "a replica lost for good makes the run a failure; stderr:\n{}",
        fleet.stderr()
    );
}

/// Rule: the local fleet writes under the same client id as a replica started by hand with
/// no flags, the one default defined in `Identity`; the banner says which id it is.
#[test]
fn the_fleet_and_a_replica_started_by_hand_share_the_default_client_id() {
    let default = named_id(Identity::DEFAULT_CLIENT).to_string();
    let mut fleet = Fleet::start(
        &FleetStore::Memory,
        1,
        &[("FLEET_MAX_SECONDS", FLEET_MAX_SECONDS)],
    );
    let banner = fleet
        .stdout
        .iter()
        .find(|l| l.contains("client id"))
        .cloned()
        .unwrap_or_else(|| panic!("no client id in the banner: {:#?}", fleet.stdout));
    assert!(banner.contains(&default), "{banner} (default {default})");
    let up = fleet
        .stdout
        .iter()
        .find(|l| l.starts_with("Tally fleet up:"))
        .cloned()
        .unwrap_or_default();
    assert!(
        up.contains("store=memory") && up.contains("projection=memory"),
        "the banner names the store and the projection: {up}"
    );
    let replica_log = fleet
        .work_dir
        .as_ref()
        .map(|d| d.join(format!("replica-{}.log", port_of(&fleet.replicas[0]))))
        .expect("fleet.sh names its work dir");
    let logged = std::fs::read_to_string(&replica_log).unwrap_or_default();
    assert!(
        logged.contains(&format!("client_id={default}")),
        "the replica writes under the default: {logged}"
    );
    fleet.stop();
    assert_eq!(by_hand_client_id(), default, "a replica started by hand");
}

fn port_of(base: &str) -> &str {
    base.rsplit(':').next().unwrap_or_default()
}

/// The client id `tally` logs when started with no client id setting, as by hand.
fn by_hand_client_id() -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tally"));
    for (name, _) in std::env::vars() {
        if name.starts_with("TALLY_") || name == "RUST_LOG" {
            cmd.env_remove(name);
        }
    }
    let mut child = cmd
        .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("tally starts");
    let stdout = child.stdout.take().expect("stdout");
    let line = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.contains("tally listening"));
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("tally logs that it listens");
    let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
    v["fields"]["client_id"].as_str().unwrap_or("").to_owned()
}
