//! Accepted connections: Nagle's algorithm off, and at most
//! `max_connections` at once. Each connection may hold up to its HTTP/2
//! window of received data the server has not read yet, so their number
//! bounds that memory. Past it, a new connection is closed at once (the
//! client sees UNAVAILABLE and can retry) rather than left waiting, and a
//! connection that sends nothing within `FIRST_BYTES` is closed, so that
//! sockets opened and left silent cannot hold every slot.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Sleep;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// How long a new connection may stay silent (the TLS handshake or the
/// HTTP/2 preface is its first bytes).
const FIRST_BYTES: Duration = Duration::from_secs(10);

/// A connection holding one of the server's connection slots until closed.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    /// Until the first bytes arrive.
    silence: Option<Pin<Box<Sleep>>>,
}

/// Accepted connections, at most `limit` open at once. `Server::tcp_nodelay`
/// applies only to listeners tonic binds itself; without it here, small
/// responses wait for delayed ACKs (tens of milliseconds per call).
pub(crate) fn incoming(listener: TcpListener, limit: usize) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(1);
    let slots = Arc::new(Semaphore::new(limit));
    tokio::spawn(async move {
        let mut warned: Option<Instant> = None;
        loop {
            let accepted = match listener.accept().await {
                Err(e) => Err(e),
                Ok((stream, peer)) => match Arc::clone(&slots).try_acquire_owned() {
                    Ok(slot) => stream.set_nodelay(true).map(|()| Conn {
                        stream,
                        _slot: slot,
                        silence: Some(Box::pin(tokio::time::sleep(FIRST_BYTES))),
                    }),
                    Err(_) => {
                        if warned.is_none_or(|at| at.elapsed() > Duration::from_secs(10)) {
                            tracing::warn!(%peer, limit, "max_connections reached; closing new connections");
                            warned = Some(Instant::now());
                        }
                        continue; // dropping the stream closes it
                    }
                },
            };
            // The server stopped: no one takes connections any more.
            if tx.send(accepted).await.is_err() {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if self.silence.is_some() {
            if matches!(read, Poll::Ready(Ok(()))) && buf.filled().len() > before {
                self.silence = None;
            } else if read.is_pending()
                && let Some(silence) = self.silence.as_mut()
                && silence.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the connection sent nothing",
                )));
            }
        }
        read
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
