//! What a request's access-log line says beyond its method, route, status and latency: the
//! hash of its idempotency key and, for a write, the attempts and outcome of the run that
//! served it. The parts that learn these (the write handler, the write loop) note them here;
//! the access log (`http::layer::access_log`) reads the note once, when it writes the line.
//!
//! A note, not a `tracing` span with fields recorded on it: a formatting subscriber formats a
//! span's fields when it is made and again on every field recorded, and each request would
//! pay for that (about a tenth of a deposit's instructions, BENCHMARKS.md "Tally's own CPU")
//! to produce one line. The note is a task-local, so the write loop, which knows nothing of
//! HTTP, fills in the request it runs for; a request with no note (a test, a start-up step)
//! notes nothing.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

tokio::task_local! {
    static CURRENT: Arc<RequestNote>;
}

/// One request's note; shared by the tasks that serve the request.
#[derive(Debug, Default)]
pub struct RequestNote {
    /// The authenticated caller (`sub`); never the token.
    caller: OnceLock<String>,
    key_hash: OnceLock<String>,
    run: Mutex<Option<RunNote>>,
}

/// What the write loop's run for a request did: its attempts, and how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunNote {
    pub attempts: u32,
    pub outcome: &'static str,
}

impl RequestNote {
    /// Runs `fut` with this note as the current one (for the request's own task, and for a
    /// task spawned to serve it, which does not inherit task-locals).
    pub fn scope<F: Future>(self: Arc<Self>, fut: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(self, fut)
    }

    /// Runs `f` with this note as the current one: for the layers that check a request
    /// as they are called, before its future runs.
    pub fn sync_scope<R>(self: Arc<Self>, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(self, f)
    }

    /// Notes the authenticated caller on the current request, if there is one.
    pub fn caller(id: impl FnOnce() -> String) {
        let _ = CURRENT.try_with(|note| {
            note.caller.get_or_init(id);
        });
    }

    pub fn noted_caller(&self) -> Option<&str> {
        self.caller.get().map(String::as_str)
    }

    /// The current task's note, to hand to a task spawned on the request's behalf.
    pub fn current() -> Option<Arc<RequestNote>> {
        CURRENT.try_with(Arc::clone).ok()
    }

    /// Notes the key's hash on the current request, if there is one. The first noting wins:
    /// a request has one key.
    pub fn key_hash(hash: impl FnOnce() -> String) {
        let _ = CURRENT.try_with(|note| {
            note.key_hash.get_or_init(hash);
        });
    }

    /// Notes the run that served the current request, if there is one (the last wins: a
    /// request served by several rounds reports the one that answered it).
    pub fn run(run: RunNote) {
        let _ = CURRENT.try_with(|note| *note.run.lock() = Some(run));
    }

    pub fn noted_key_hash(&self) -> Option<&str> {
        self.key_hash.get().map(String::as_str)
    }

    pub fn noted_run(&self) -> Option<RunNote> {
        *self.run.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_note_is_filled_in_by_the_task_it_scopes_and_by_a_task_handed_it() {
        let note = Arc::new(RequestNote::default());
        note.clone()
            .scope(async {
                RequestNote::key_hash(|| "abc".into());
                RequestNote::key_hash(|| "ignored".into());
                let handed = RequestNote::current().expect("a note in scope");
                tokio::spawn(handed.scope(async {
                    RequestNote::run(RunNote {
                        attempts: 2,
                        outcome: "ok",
                    })
                }))
                .await
                .expect("the spawned task");
            })
            .await;
        assert_eq!(note.noted_key_hash(), Some("abc"));
        assert_eq!(
            note.noted_run(),
            Some(RunNote {
                attempts: 2,
                outcome: "ok"
            })
        );
    }

    #[tokio::test]
    async fn outside_a_request_nothing_is_noted_and_nothing_fails() {
        assert!(RequestNote::current().is_none());
        RequestNote::key_hash(|| unreachable!("no note to fill"));
        RequestNote::run(RunNote {
            attempts: 1,
            outcome: "ok",
        });
    }
}
