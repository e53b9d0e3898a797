//! Accepted connections: Nagle's algorithm off, and at most
//! `max_connections` at once. Each connection may hold up to its HTTP/2
//! window of received data the server has not read yet, so their number
//! bounds that memory; past it, new connections wait in the listen backlog
//! until one closes.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A connection holding one of the server's connection slots until closed.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

/// Accepted connections, at most `limit` open at once. `Server::tcp_nodelay`
/// applies only to listeners tonic binds itself; without it here, small
/// responses wait for delayed ACKs (tens of milliseconds per call).
pub(crate) fn incoming(listener: TcpListener, limit: usize) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(1);
    let slots = Arc::new(Semaphore::new(limit));
    tokio::spawn(async move {
        loop {
            let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
                return;
            };
            let accepted = listener.accept().await.and_then(|(stream, _)| {
                stream.set_nodelay(true)?;
                Ok(Conn { stream, _slot: slot })
            });
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
        Pin::new(&mut self.stream).poll_read(cx, buf)
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
