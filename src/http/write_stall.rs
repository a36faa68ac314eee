//! The write stall limit (`--write-stall-secs`): a write that waits that long on a socket
//! whose client takes none of it fails, which closes the connection, so a client that reads
//! nothing holds no connection for ever. The API listener's sockets apply it in
//! [`super::gate::GatedIo`]; the admin listener's in [`StallLimited`].

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus::IntCounter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// One connection's stall clock.
pub struct WriteStall {
    limit: Duration,
    /// Running while a write waits on a full socket.
    stalled: Option<Pin<Box<Sleep>>>,
    /// `tally_http_write_stalls_total`.
    stalls: IntCounter,
}

impl WriteStall {
    pub fn new(limit: Duration, stalls: IntCounter) -> Self {
        WriteStall {
            limit,
            stalled: None,
            stalls,
        }
    }

    /// The socket took a write, or has room: the clock stops.
    pub fn cleared(&mut self) {
        self.stalled = None;
    }

    /// The socket is full: pending (woken at the limit) until the limit has passed since
    /// it first was, then the error that closes the connection, counted.
    pub fn full(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let limit = self.limit;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if stalled.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.stalls.inc();
        Poll::Ready(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client took none of the answer within the write stall limit",
        ))
    }
}

/// A socket whose writes obey a [`WriteStall`]; reads pass through.
pub struct StallLimited<S> {
    inner: S,
    stall: WriteStall,
}

impl<S> StallLimited<S> {
    pub fn new(inner: S, stall: WriteStall) -> Self {
        StallLimited { inner, stall }
    }

    /// A write's outcome, through the stall clock.
    fn through<T>(
        &mut self,
        cx: &mut Context<'_>,
        done: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match done {
            Poll::Pending => self.stall.full(cx).map(Err),
            done => {
                self.stall.cleared();
                done
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for StallLimited<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallLimited<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.through(cx, done)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.through(cx, done)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_flush(cx);
        this.through(cx, done)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
