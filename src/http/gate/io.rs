//! The socket under hyper: a client connection whose reads pass the gate ([`super::conn`],
//! rules 1 to 3) and whose writes give the slot back while the client does not read (rule 7)
//! and fail once it has not read for the stall limit.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Wake, Waker, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

use super::conn::{ConnSlot, Decision, peek};
use super::slots::Gate;
use crate::http::write_stall::WriteStall;

/// Reads what the socket holds into `buf`. A read that did not fill `buf` emptied the
/// socket's receive queue, so the socket's readiness is cleared with it, as tokio's own
/// `TcpStream` reads do: the next poll then waits for new bytes instead of asking the
/// kernel once more only to hear `WouldBlock` (a system call per request saved). The
/// readiness is cleared against the event seen *before* the read, so bytes that arrive
/// meanwhile keep their wake-up.
fn read_draining(stream: &TcpStream, buf: &mut ReadBuf<'_>) -> io::Result<()> {
    let room = buf.remaining();
    let mut read = 0;
    let drained = stream.try_io(Interest::READABLE, || {
        read = stream.try_read_buf(buf)?;
        if read > 0 && read < room {
            // Clears the readiness; the bytes read are returned below.
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(())
    });
    match drained {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock && read > 0 => Ok(()),
        other => other,
    }
}

/// The waker an idle connection leaves with its socket.
struct OnReadable(Weak<ConnSlot>);

impl Wake for OnReadable {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(conn) = self.0.upgrade() {
            conn.on_readable();
        }
    }
}

/// A client socket whose reads pass the gate (rules 1 to 3).
///
/// The socket is shared with the readiness callback (which peeks at it), so reads and
/// writes go through tokio's `&self` readiness API (`poll_*_ready` then `try_*`), as its
/// own `AsyncRead` for `TcpStream` does.
pub struct GatedIo {
    stream: Arc<TcpStream>,
    conn: Arc<ConnSlot>,
    /// [`OnReadable`] for this connection, made once.
    readable: Waker,
    /// How long a write may wait for the client to take any of it (`--write-stall-secs`).
    stall: WriteStall,
}

impl GatedIo {
    /// Wraps `stream`; the returned [`ConnSlot`] is the handle its requests' handlers use.
    pub fn new(stream: TcpStream, gate: Arc<Gate>, stall_limit: Duration) -> (Self, Arc<ConnSlot>) {
        let stream = Arc::new(stream);
        let conn = ConnSlot::with_stream(gate, Arc::downgrade(&stream));
        let readable = Waker::from(Arc::new(OnReadable(Arc::downgrade(&conn))));
        let stall = WriteStall::new(stall_limit, conn.gate.metrics.http_write_stalls.clone());
        let io = GatedIo {
            stream,
            conn: conn.clone(),
            readable,
            stall,
        };
        (io, conn)
    }

    /// The socket's write readiness. A full socket gives the slot back (rule 7), and one
    /// that stays full for the stall limit fails the write, which closes the connection: a
    /// client that reads nothing holds neither a slot nor a connection for ever.
    fn poll_write_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Poll::Ready(ready) = self.stream.poll_write_ready(cx) {
            self.stall.cleared();
            return Poll::Ready(ready);
        }
        self.conn.write_blocked();
        self.stall.full(cx).map(Err)
    }

    /// Ready once this connection holds a slot or may read without one.
    fn poll_slot(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            {
                let mut s = self.conn.state.lock();
                if s.may_read() {
                    return Poll::Ready(Ok(()));
                }
                s.keep_waker(cx.waker());
                if s.is_queued() {
                    return Poll::Pending;
                }
            }
            // Idle: from here readiness goes to the callback, not to this task.
            ready!(
                self.stream
                    .poll_read_ready(&mut Context::from_waker(&self.readable))
            )?;
            let mut s = self.conn.state.lock();
            let Some((idle_since, access)) = s.undecided() else {
                // The callback decided first.
                continue;
            };
            match self
                .conn
                .decide(idle_since, access, || peek(&self.stream, cx))
            {
                Decision::Read => return Poll::Ready(Ok(())),
                Decision::Wait => return Poll::Pending,
                // The peek found nothing and cleared the readiness: register again.
                Decision::Stale => continue,
            }
        }
    }
}

impl Drop for GatedIo {
    fn drop(&mut self) {
        self.conn.close();
    }
}

impl AsyncRead for GatedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            ready!(this.poll_slot(cx))?;
            match this.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => match read_draining(&this.stream, buf) {
                    Ok(()) => return Poll::Ready(Ok(())),
                    // The readiness is cleared; the next round waits for the socket.
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Poll::Ready(Err(e)),
                },
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                // Nothing to read. Serving a request, the task waits for its socket; idle,
                // the slot goes back and the next round leaves the callback with the socket.
                Poll::Pending if this.conn.go_idle() => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl AsyncWrite for GatedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            ready!(this.poll_write_ready(cx))?;
            match this.stream.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                written => return Poll::Ready(written),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            ready!(this.poll_write_ready(cx))?;
            match this.stream.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                written => return Poll::Ready(written),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Writes go straight to the socket.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // What tokio's own `poll_shutdown` for a `TcpStream` does, from a shared reference.
        Poll::Ready(socket2::SockRef::from(&*self.stream).shutdown(std::net::Shutdown::Write))
    }
}
