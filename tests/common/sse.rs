//! A server-sent-events client for the watch suites: opens a stream and yields
//! its events and comments one at a time, each within a bound.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;

use super::TestApp;

/// How long any one expected event may take.
pub const EVENT_BOUND: Duration = Duration::from_secs(10);

/// One server-sent event (or comment), as a client sees it.
#[derive(Clone, Debug, Default)]
pub struct Sse {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
    pub comment: bool,
}

impl Sse {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data).unwrap_or_else(|e| panic!("data {:?}: {e}", self.data))
    }
    pub fn name(&self) -> &str {
        self.event.as_deref().unwrap_or("message")
    }
}

/// An open event stream, read chunk by chunk.
pub struct Stream {
    resp: reqwest::Response,
    buf: String,
}

impl Stream {
    pub async fn open(t: &TestApp, path: &str, last_event_id: Option<&str>) -> Stream {
        let mut req = t.client.get(t.url(path));
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id);
        }
        let resp = req.send().await.expect("stream opened");
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        assert_eq!(
            resp.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        Stream {
            resp,
            buf: String::new(),
        }
    }

    /// The next event or comment; `None` when the stream ended.
    pub async fn next_any(&mut self) -> Option<Sse> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let mut sse = Sse::default();
                let mut fields = 0;
                for line in block.lines() {
                    if let Some(c) = line.strip_prefix(':') {
                        sse.comment = true;
                        sse.data = c.trim().to_string();
                    } else if let Some((k, v)) = line.split_once(": ") {
                        fields += 1;
                        match k {
                            "id" => sse.id = Some(v.to_string()),
                            "event" => sse.event = Some(v.to_string()),
                            "data" => sse.data = v.to_string(),
                            _ => {}
                        }
                    }
                }
                // A `retry:`-only block dispatches nothing.
                if fields == 0 && !sse.comment || block.starts_with("retry:") {
                    continue;
                }
                return Some(sse);
            }
            let chunk = tokio::time::timeout(EVENT_BOUND, self.resp.chunk())
                .await
                .expect("an event within the bound")
                .expect("stream readable")?;
            self.buf
                .push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        }
    }

    /// The next event, skipping keep-alive comments.
    pub async fn next(&mut self) -> Sse {
        loop {
            let e = self.next_any().await.expect("the stream goes on");
            if !e.comment {
                return e;
            }
        }
    }
}
