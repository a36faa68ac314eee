//! Every event the two watch streams send, checked against the event schemas
//! `docs/openapi.json` documents for them (`itemSchema` of each stream's 200): the events the
//! contract run cannot provoke (`trimmed`, `lagged`, `gap`, `shutdown`, `error`, `expired`)
//! as well as those it reads off a live stream.
//!
//! Each event is read the way an SSE parser hands it over (as Schemathesis and the OpenAPI
//! 3.2 SSE model do): an object of `event` (`message` when unnamed), `data` (the data lines
//! joined) and `id` (the last id seen, carried over to events that send none). The schemas
//! are checked by [`valid`], which knows the keywords the event schemas use and refuses any
//! other, so a keyword it cannot check never passes unchecked. It is written here rather
//! than taken from a JSON Schema crate because the check that matters is `data` against its
//! `contentSchema`: JSON Schema 2020-12 makes that an annotation, which validators do not
//! apply, while Schemathesis (and so the contract) does.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::*;
use crate::account::AccountEvent;
use crate::account::holds::HoldId;
use crate::reader::{HistoryEntry, Writer};
use crate::watch::Entry;

/// Keywords [`valid`] checks, and those it may pass over (annotations).
const CHECKED: [&str; 15] = [
    "$ref",
    "oneOf",
    "allOf",
    "type",
    "required",
    "properties",
    "additionalProperties",
    "unevaluatedProperties",
    "const",
    "enum",
    "minimum",
    "pattern",
    "format",
    "contentMediaType",
    "contentSchema",
];
const ANNOTATIONS: [&str; 2] = ["description", "maximum"];

fn spec() -> Value {
    serde_json::from_str(crate::http::openapi::DOCUMENT).expect("docs/openapi.json is JSON")
}

/// The schema `reference` (`#/...`) points at in `root`.
fn resolve<'a>(root: &'a Value, reference: &str) -> &'a Value {
    let pointer = reference.strip_prefix('#').expect("a local reference");
    root.pointer(pointer)
        .unwrap_or_else(|| panic!("{reference} is in the spec"))
}

/// Whether `value` is valid under `schema`; `Err` says where it is not.
fn valid(root: &Value, schema: &Value, value: &Value) -> Result<(), String> {
    let schema = schema.as_object().expect("a schema object");
    for keyword in schema.keys() {
        let known = CHECKED.contains(&keyword.as_str()) || ANNOTATIONS.contains(&keyword.as_str());
        assert!(known, "a keyword this check does not know: {keyword}");
    }
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
        valid(root, resolve(root, reference), value)?;
    }
    for sub in schema
        .get("allOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        valid(root, sub, value)?;
    }
    if let Some(branches) = schema.get("oneOf").and_then(Value::as_array) {
        let matching = branches
            .iter()
            .filter(|b| valid(root, b, value).is_ok())
            .count();
        if matching != 1 {
            return Err(format!("{value} matches {matching} of oneOf"));
        }
    }
    valid_here(root, schema, value)
}

/// The keywords that look at `value` itself.
fn valid_here(root: &Value, schema: &Map<String, Value>, value: &Value) -> Result<(), String> {
    let fail = |why: &str| Err(format!("{value}: {why}"));
    if let Some(types) = schema.get("type") {
        let names: Vec<&str> = match types {
            Value::Array(names) => names.iter().filter_map(Value::as_str).collect(),
            name => vec![name.as_str().expect("a type name")],
        };
        if !names.iter().any(|t| is_type(value, t)) {
            return fail(&format!("not of type {types}"));
        }
    }
    if schema.get("const").is_some_and(|c| c != value) {
        return fail("not the const");
    }
    let listed = schema.get("enum").and_then(Value::as_array);
    if listed.is_some_and(|values| !values.contains(value)) {
        return fail("not in the enum");
    }
    let minimum = schema.get("minimum").and_then(Value::as_i64);
    if minimum.is_some_and(|min| value.as_i64().is_some_and(|n| n < min)) {
        return fail("under the minimum");
    }
    if let Some(text) = value.as_str() {
        valid_string(root, schema, text).map_err(|why| format!("{value}: {why}"))?;
    }
    if let Some(object) = value.as_object() {
        valid_object(root, schema, object)?;
    }
    Ok(())
}

fn is_type(value: &Value, name: &str) -> bool {
    match name {
        "object" => value.is_object(),
        "string" => value.is_string(),
        "integer" => value.is_i64() || value.is_u64(),
        "null" => value.is_null(),
        other => panic!("a type this check does not know: {other}"),
    }
}

fn valid_string(root: &Value, schema: &Map<String, Value>, text: &str) -> Result<(), String> {
    let digits = (1..=19).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_digit());
    match schema.get("pattern").and_then(Value::as_str) {
        None => {}
        // The one pattern the event schemas use: a version as an event id.
        Some("^[0-9]{1,19}$") if !digits => return Err("not 1 to 19 digits".into()),
        Some("^[0-9]{1,19}$") => {}
        Some(other) => panic!("a pattern this check does not know: {other}"),
    }
    match schema.get("format").and_then(Value::as_str) {
        None => {}
        Some("uuid") => {
            Uuid::parse_str(text).map_err(|e| format!("not a UUID: {e}"))?;
        }
        Some(other) => panic!("a format this check does not know: {other}"),
    }
    if let Some(content) = schema.get("contentSchema") {
        assert_eq!(schema["contentMediaType"], "application/json");
        let data: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        valid(root, content, &data)?;
    }
    Ok(())
}

fn valid_object(
    root: &Value,
    schema: &Map<String, Value>,
    object: &Map<String, Value>,
) -> Result<(), String> {
    for name in schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = name.as_str().expect("a property name");
        if !object.contains_key(name) {
            return Err(format!("{object:?} lacks {name}"));
        }
    }
    let properties = schema.get("properties").and_then(Value::as_object);
    for (name, value) in object {
        if let Some(property) = properties.and_then(|p| p.get(name)) {
            valid(root, property, value).map_err(|why| format!("{name}: {why}"))?;
        }
    }
    let closed = |keyword: &str| schema.get(keyword) == Some(&Value::Bool(false));
    let known = if closed("unevaluatedProperties") {
        Some(evaluated(root, schema))
    } else if closed("additionalProperties") {
        Some(
            properties
                .map(|p| p.keys().cloned().collect())
                .unwrap_or_default(),
        )
    } else {
        None
    };
    if let Some(unknown) = known.and_then(|k| object.keys().find(|name| !k.contains(*name))) {
        return Err(format!(
            "{object:?} has {unknown}, which its schema does not name"
        ));
    }
    Ok(())
}

/// The properties `schema` and the schemas it applies in place (`$ref`, `allOf`) name.
fn evaluated(root: &Value, schema: &Map<String, Value>) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default();
    let mut applied: Vec<&Value> = schema
        .get("allOf")
        .and_then(Value::as_array)
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
        applied.push(resolve(root, reference));
    }
    for sub in applied {
        names.extend(evaluated(root, sub.as_object().expect("a schema object")));
    }
    names
}

/// SSE text as the events a parser hands over (comments and data-less blocks are none).
fn events(text: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut last_id: Option<String> = None;
    for block in text.split("\n\n") {
        let (mut event, mut data, mut id) = (None, Vec::new(), None);
        for line in block.lines().filter(|l| !l.starts_with(':')) {
            let (field, value) = line.split_once(": ").unwrap_or((line, ""));
            match field {
                "event" => event = Some(value.to_string()),
                "data" => data.push(value),
                "id" => id = Some(value.to_string()),
                _ => {}
            }
        }
        if id.is_some() {
            last_id = id;
        }
        if data.is_empty() {
            continue;
        }
        let mut parsed = json!({
            "event": event.unwrap_or_else(|| "message".into()),
            "data": data.join("\n"),
        });
        if let Some(id) = &last_id {
            parsed["id"] = json!(id);
        }
        out.push(parsed);
    }
    out
}

/// The events `items` make on a stream that then ends; when `expired`, the stream's token
/// runs out after the items instead (its subscription still open).
async fn stream_events(items: Vec<Item>, expired: bool) -> Vec<Value> {
    let (tx, rx) = mpsc::channel(items.len() + 1);
    for item in items {
        tx.send(item).await.expect("room");
    }
    let mut body = tests::body(rx);
    let open = if expired {
        body.expires = Some(Box::pin(tokio::time::sleep(Duration::ZERO)));
        Some(tx)
    } else {
        drop(tx);
        None
    };
    let text = tokio::time::timeout(Duration::from_secs(10), tests::text(body))
        .await
        .expect("the stream ends");
    drop(open);
    events(&text)
}

fn account(n: u128) -> AccountId {
    AccountId(Uuid::from_u128(n))
}

fn entry(version: u64, event: AccountEvent, writer: Writer) -> Entry {
    Entry {
        history: HistoryEntry {
            version,
            server_timestamp_ms: 1_700_000_000_000,
            event_id: Some(7),
            event,
            writer,
        },
        balance_cents: Some(40),
    }
}

/// Every ending a stream can have.
fn endings() -> Vec<Item> {
    vec![
        Item::End(EndReason::Lagged {
            last_version: Some(3),
        }),
        Item::End(EndReason::Lagged { last_version: None }),
        Item::End(EndReason::Shutdown),
        Item::End(EndReason::FeedGap),
        Item::End(EndReason::StoreError("the store is gone".into())),
        Item::End(EndReason::Unreadable {
            version: 4,
            reason: "bad bytes".into(),
        }),
    ]
}

/// Every event of an account stream, each ending on a stream of its own.
async fn account_stream_events() -> Vec<Value> {
    let batch = AccountFrame {
        account: account(1),
        version: 5,
        entries: vec![
            entry(5, AccountEvent::Deposited { amount: 10 }, Writer::Service),
            entry(5, AccountEvent::Withdrawn { amount: 2 }, Writer::Client(9)),
            entry(
                5,
                AccountEvent::TransferredOut {
                    amount: 3,
                    to: account(2),
                },
                Writer::Service,
            ),
            entry(
                5,
                AccountEvent::TransferredIn {
                    amount: 4,
                    from: account(2),
                },
                Writer::Service,
            ),
            entry(5, AccountEvent::Opened, Writer::Service),
            entry(
                5,
                AccountEvent::HoldPlaced {
                    amount: 5,
                    to: Some(account(2)),
                    expires_in_secs: std::num::NonZeroU32::new(60),
                },
                Writer::Service,
            ),
            entry(
                5,
                AccountEvent::HoldPosted {
                    hold: HoldId(Uuid::from_u128(7)),
                    amount: 4,
                },
                Writer::Service,
            ),
            entry(
                5,
                AccountEvent::HoldVoided {
                    hold: HoldId(Uuid::from_u128(8)),
                },
                Writer::Service,
            ),
            entry(
                5,
                AccountEvent::HoldExpired {
                    hold: HoldId(Uuid::from_u128(9)),
                },
                Writer::Service,
            ),
        ],
        encoded: OnceLock::new(),
    };
    let mut unfolded = entry(6, AccountEvent::Deposited { amount: 1 }, Writer::Service);
    unfolded.balance_cents = None;
    let start = vec![
        Item::Snapshot {
            account: account(1),
            version: 4,
            balance_cents: Some(31),
        },
        Item::Snapshot {
            account: account(1),
            version: 0,
            balance_cents: None,
        },
        Item::Trimmed {
            from_version: 1,
            first_available: 3,
        },
        Item::Events(Arc::new(batch)),
        Item::Events(Arc::new(AccountFrame {
            account: account(1),
            version: 6,
            entries: vec![unfolded],
            encoded: OnceLock::new(),
        })),
        Item::KeepAlive,
    ];
    streams(start).await
}

/// `start` followed by each ending in turn, and by the token's expiry.
async fn streams(start: Vec<Item>) -> Vec<Value> {
    let mut out = Vec::new();
    for end in endings() {
        let mut items = start.clone();
        items.push(end);
        out.extend(stream_events(items, false).await);
    }
    out.extend(stream_events(start, true).await);
    out
}

/// The event names a stream's item schema documents.
fn documented_names(schema: &Value) -> BTreeSet<String> {
    schema["oneOf"]
        .as_array()
        .expect("one schema per event")
        .iter()
        .map(|b| {
            b["properties"]["event"]["const"]
                .as_str()
                .expect("named")
                .to_owned()
        })
        .collect()
}

fn check_stream(path: &str, sent: &[Value]) {
    let spec = spec();
    let content = &spec["paths"][path]["get"]["responses"]["200"]["content"]["text/event-stream"];
    let schema = resolve(
        &spec,
        content["itemSchema"]["$ref"].as_str().expect("a $ref"),
    );
    for event in sent {
        if valid(&spec, schema, event).is_err() {
            // The reason, from the schema of the event's own name.
            let own = schema["oneOf"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|b| b["properties"]["event"]["const"] == event["event"]);
            let why = own.map_or(Err("no schema of its name".into()), |b| {
                valid(&spec, b, event)
            });
            panic!("{path}: {event} is not as documented: {why:?}");
        }
    }
    let names: BTreeSet<String> = sent
        .iter()
        .map(|e| e["event"].as_str().expect("named").to_owned())
        .collect();
    assert_eq!(
        names,
        documented_names(schema),
        "{path}: sent vs documented"
    );
}

/// Rule: every event an account stream sends is one its documented item schema allows
/// (name, id, data), and every event the schema documents is one the stream sends.
#[tokio::test]
async fn every_account_stream_event_is_as_documented() {
    let sent = account_stream_events().await;
    check_stream("/api/accounts/{id}/events", &sent);
}

/// Rule: the same for the fleet-wide stream.
#[tokio::test]
async fn every_fleet_stream_event_is_as_documented() {
    let write = |n: u128, version: u64| {
        Item::Write(Arc::new(WriteFrame {
            account: account(n),
            version,
            encoded: OnceLock::new(),
        }))
    };
    let sent = streams(vec![write(1, 1), Item::KeepAlive, write(2, 9)]).await;
    check_stream("/api/watch/stream", &sent);
}

/// Rule: the check itself refuses an event whose data drifts from the schema (a renamed
/// field, a field too many, a wrong type, a missing id), so the tests above can fail.
#[test]
fn a_drifted_event_is_refused() {
    let spec = spec();
    let schema = resolve(&spec, "#/components/schemas/AccountStreamEvent");
    let snapshot = |data: Value, id: Option<&str>| {
        let mut e = json!({"event": "snapshot", "data": data.to_string()});
        if let Some(id) = id {
            e["id"] = json!(id);
        }
        e
    };
    let account = Uuid::from_u128(1).to_string();
    let good = json!({"accountId": account, "aggregateVersion": 4, "balanceCents": 3});
    assert_eq!(
        valid(&spec, schema, &snapshot(good.clone(), Some("4"))),
        Ok(())
    );
    let renamed = json!({"accountId": account, "version": 4, "balanceCents": 3});
    let more = json!({"accountId": account, "aggregateVersion": 4, "balanceCents": 3, "x": 1});
    let typed = json!({"accountId": account, "aggregateVersion": "4", "balanceCents": 3});
    for (data, id) in [
        (renamed, Some("4")),
        (more, Some("4")),
        (typed, Some("4")),
        (good.clone(), None),
        (good, Some("v4")),
    ] {
        let event = snapshot(data, id);
        assert!(valid(&spec, schema, &event).is_err(), "{event}");
    }
    let mut deposit = account_event_data("Deposited");
    assert_eq!(valid(&spec, schema, &deposit), Ok(()));
    deposit["event"] = json!("Withdrawn");
    assert!(
        valid(&spec, schema, &deposit).is_err(),
        "its type names its event"
    );
}

fn account_event_data(kind: &str) -> Value {
    let data = json!({
        "aggregateVersion": 5, "timestamp": 1, "type": kind, "amountCents": 3,
        "writer": "service", "balanceCents": 9, "accountId": Uuid::from_u128(1).to_string(),
    });
    json!({"event": kind, "data": data.to_string(), "id": "5"})
}
