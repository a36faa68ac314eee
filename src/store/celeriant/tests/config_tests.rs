//! The Celeriant flags and their validation.

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    celeriant: CeleriantConfig,
}

fn parse(args: &[&str]) -> Result<CeleriantConfig, clap::Error> {
    let mut argv = vec!["tally", "--celeriant-address", "10.1.2.3:10000"];
    argv.extend_from_slice(args);
    Cli::try_parse_from(argv).map(|c| c.celeriant)
}

#[test]
fn flags_parse_into_the_config() {
    let cfg = parse(&[
        "--celeriant-seeds",
        "a:1,b:2",
        "--celeriant-request-timeout-ms",
        "750",
        "--celeriant-connect-timeout-ms",
        "250",
        "--celeriant-pool-size",
        "4",
        "--celeriant-tls-ca",
        "/ca.pem",
        "--celeriant-tls-cert",
        "/c.pem",
        "--celeriant-tls-key",
        "/k.pem",
        "--celeriant-tls-server-name",
        "db.internal",
        "--celeriant-api-key",
        "c2VjcmV0",
    ])
    .expect("parses");
    assert_eq!(cfg.address, "10.1.2.3:10000");
    assert_eq!(cfg.seeds, vec!["a:1".to_owned(), "b:2".to_owned()]);
    assert_eq!(cfg.request_timeout_ms, 750);
    assert_eq!(cfg.connect_timeout_ms, 250);
    assert_eq!(cfg.pool_size, 4);
    assert_eq!(cfg.tls_ca, Some(PathBuf::from("/ca.pem")));
    assert_eq!(cfg.tls_server_name.as_deref(), Some("db.internal"));
    assert_eq!(cfg.api_key, Some(ApiKey("c2VjcmV0".into())));
    assert_eq!(cfg.validate(), Ok(()));
}

#[test]
fn a_non_numeric_timeout_is_a_parse_error() {
    assert!(parse(&["--celeriant-request-timeout-ms", "soon"]).is_err());
}

#[test]
fn defaults_validate() {
    assert_eq!(CeleriantConfig::default().validate(), Ok(()));
}

#[test]
fn the_api_key_never_shows_in_debug_output() {
    let cfg = CeleriantConfig {
        api_key: Some("top-secret-key".parse().expect("non-empty")),
        ..CeleriantConfig::default()
    };
    let shown = format!("{cfg:?}");
    assert!(!shown.contains("top-secret-key"), "{shown}");
    assert!(shown.contains("redacted"));
    let log = CeleriantLog::connect(&cfg).expect("valid");
    assert!(!format!("{log:?}").contains("top-secret-key"));
}

#[test]
fn an_empty_api_key_is_refused() {
    assert!(ApiKey::from_str("  ").is_err());
    assert!(parse(&["--celeriant-api-key", ""]).is_err());
}

fn rejected_flag(cfg: CeleriantConfig) -> &'static str {
    match cfg.validate() {
        Err(CeleriantConfigError::Invalid { flag, .. }) => flag,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn validate_names_the_bad_setting() {
    let base = CeleriantConfig::default;
    for address in [
        "",
        "nohost",
        ":10000",
        "host:",
        "host:0",
        "host:99999",
        "a b:1",
    ] {
        let cfg = CeleriantConfig {
            address: address.into(),
            ..base()
        };
        assert_eq!(rejected_flag(cfg), "--celeriant-address", "{address:?}");
    }
    let cfg = CeleriantConfig {
        seeds: vec!["ok:1".into(), "bad".into()],
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-seeds");
    let cfg = CeleriantConfig {
        seeds: vec!["h:1".into(); MAX_SEEDS + 1],
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-seeds");
    for ms in [0, MAX_TIMEOUT_MS + 1] {
        let cfg = CeleriantConfig {
            request_timeout_ms: ms,
            ..base()
        };
        assert_eq!(rejected_flag(cfg), "--celeriant-request-timeout-ms");
        let cfg = CeleriantConfig {
            connect_timeout_ms: ms,
            ..base()
        };
        assert_eq!(rejected_flag(cfg), "--celeriant-connect-timeout-ms");
    }
    for size in [0, MAX_POOL_SIZE + 1] {
        let cfg = CeleriantConfig {
            pool_size: size,
            ..base()
        };
        assert_eq!(rejected_flag(cfg), "--celeriant-pool-size");
    }
    let cfg = CeleriantConfig {
        tls_ca: Some("/ca".into()),
        tls_cert: Some("/c".into()),
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-tls-key");
    let cfg = CeleriantConfig {
        tls_ca: Some("/ca".into()),
        tls_key: Some("/k".into()),
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-tls-cert");
    let cfg = CeleriantConfig {
        tls_cert: Some("/c".into()),
        tls_key: Some("/k".into()),
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-tls-ca");
    let cfg = CeleriantConfig {
        tls_server_name: Some("db".into()),
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-tls-ca");
}

#[test]
fn ipv6_addresses_are_accepted() {
    let cfg = CeleriantConfig {
        address: "[::1]:10000".into(),
        ..CeleriantConfig::default()
    };
    assert_eq!(cfg.validate(), Ok(()));
}

#[test]
fn a_missing_tls_file_fails_connect_not_a_request() {
    let cfg = CeleriantConfig {
        tls_ca: Some("/nonexistent/ca.pem".into()),
        ..CeleriantConfig::default()
    };
    assert!(matches!(
        CeleriantLog::connect(&cfg),
        Err(CeleriantConfigError::Tls(_))
    ));
}
