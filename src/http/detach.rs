//! A write that outlives its request when it must, without a task of its own when it need
//! not: [`Detached`] polls the write in the request's own task, and only if the request
//! stops waiting (its client went away, or its deadline passed) hands what is left of the
//! write to a task of its own, which runs it to the end so its outcome is recorded for the
//! retry that follows. A store write is never cancelled half-way.
//!
//! Spawning every write up front did the same at the cost of a task, a join and a wake
//! across threads on every write (BENCHMARKS.md, "Tally's own CPU"); almost every write ends
//! while its request still waits.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A boxed write future that finishes detached if dropped unfinished.
pub struct Detached<F>
where
    F: Future + Send + 'static,
{
    write: Option<Pin<Box<F>>>,
}

/// A panic inside the write: the write is gone (nothing of it is detached), and the request
/// answers an internal error rather than losing its connection.
#[derive(Debug)]
pub struct WritePanicked;

impl<F> Detached<F>
where
    F: Future + Send + 'static,
{
    pub fn new(write: F) -> Self {
        Detached {
            write: Some(Box::pin(write)),
        }
    }
}

impl<F> Future for Detached<F>
where
    F: Future + Send + 'static,
{
    type Output = Result<F::Output, WritePanicked>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(write) = self.write.as_mut() else {
            // Polled after it answered: a caller's bug, answered as a failed write rather
            // than a panic on the connection.
            return Poll::Ready(Err(WritePanicked));
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| write.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => {
                self.write = None;
                Poll::Ready(Ok(out))
            }
            Err(_) => {
                self.write = None;
                Poll::Ready(Err(WritePanicked))
            }
        }
    }
}

impl<F> Drop for Detached<F>
where
    F: Future + Send + 'static,
{
    fn drop(&mut self) {
        let Some(write) = self.write.take() else {
            return;
        };
        // Without a runtime (it is shutting down) the write goes as a spawned task would.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                write.await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::sync::oneshot;

    #[tokio::test]
    async fn a_write_that_ends_while_its_request_waits_answers_in_place() {
        let answer = Detached::new(async { 7 }).await;
        assert_eq!(answer.ok(), Some(7));
    }

    #[tokio::test]
    async fn a_write_whose_request_stops_waiting_runs_to_its_end() {
        let (go, wait) = oneshot::channel::<()>();
        let (done_tx, done) = oneshot::channel::<()>();
        let write = Detached::new(async move {
            let _ = wait.await;
            let _ = done_tx.send(());
        });
        // The request gives up (a deadline) with the write still waiting.
        let cut = tokio::time::timeout(std::time::Duration::ZERO, write).await;
        assert!(cut.is_err(), "the write was still waiting");
        go.send(()).expect("the detached write still runs");
        done.await.expect("the detached write finished");
    }

    #[tokio::test]
    async fn a_panic_in_the_write_is_an_answer_not_a_lost_connection() {
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        let answer = Detached::new(async move {
            flag.store(true, Ordering::SeqCst);
            panic!("an invariant broke");
        })
        .await;
        assert!(ran.load(Ordering::SeqCst));
        assert!(answer.is_err());
    }
}
