//! The metrics port's connections: at most [`MAX_CONNECTIONS`] at once
//! (more are closed as they arrive), each for at most [`CONNECTION_LIFETIME`]
//! (a client that sends a request slowly, or keeps a connection open, is cut
//! off then), and over TLS with the gRPC port's identity where TLS is
//! configured, so that a scrape off loopback crosses the network under the
//! same protection as a call. axum gives hyper no timer, so these bounds are
//! kept here, on the connection itself.
//!
//! Handshakes run on their own tasks, bounded in time, and only finished
//! ones reach the HTTP server: one slow or silent client cannot hold up the
//! scrapes of others.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Sleep;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Connections open at once; Prometheus needs one per scraper.
pub(crate) const MAX_CONNECTIONS: usize = 32;

/// How long one connection may live, handshake included.
pub(crate) const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// Accepted connections waiting for the HTTP server.
const READY_QUEUE: usize = 64;

/// The rustls side of the server's identity (`cert` and `key` as PEM), for
/// HTTP/1.1. `Err` names what is wrong with which.
pub(crate) fn tls_config(cert: &[u8], key: &[u8]) -> Result<Arc<ServerConfig>, String> {
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("key: {e}"))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| e.to_string())?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A byte stream: TCP, or TLS over it.
trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

/// One metrics connection: its slot among [`MAX_CONNECTIONS`], held until
/// it is dropped, and its end of life, after which reads see the end of
/// the stream and writes fail.
pub(crate) struct Conn {
    io: Box<dyn Stream>,
    ends: Pin<Box<Sleep>>,
    _slot: OwnedSemaphorePermit,
}

impl Conn {
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.ends.as_mut().poll(cx).is_ready()
    }
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.expired(cx) {
            // The end of the stream: hyper closes the connection.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.expired(cx) {
            return Poll::Ready(Err(io::ErrorKind::TimedOut.into()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Accepts on the metrics port in the background; `accept` hands out
/// connections ready for HTTP. Dropping it stops accepting.
pub(crate) struct MetricsListener {
    ready: mpsc::Receiver<(Conn, SocketAddr)>,
    local: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl MetricsListener {
    /// Plaintext where `tls` is `None`.
    pub(crate) fn new(listener: TcpListener, tls: Option<Arc<ServerConfig>>) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(READY_QUEUE);
        let acceptor = tls.map(TlsAcceptor::from);
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let accepting = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of descriptors and the like: pause, as axum does.
                        tracing::warn!(error = %e, "metrics: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    tracing::debug!(%peer, "metrics: {MAX_CONNECTIONS} connections open; closing a new one");
                    continue;
                };
                let ends = Box::pin(tokio::time::sleep(CONNECTION_LIFETIME));
                let tx = tx.clone();
                let Some(acceptor) = acceptor.clone() else {
                    let conn = Conn {
                        io: Box::new(tcp),
                        ends,
                        _slot: slot,
                    };
                    let _ = tx.send((conn, peer)).await;
                    continue;
                };
                tokio::spawn(async move {
                    let handshake = tokio::time::timeout_at(ends.deadline(), acceptor.accept(tcp));
                    match handshake.await {
                        Ok(Ok(tls)) => {
                            let conn = Conn {
                                io: Box::new(tls),
                                ends,
                                _slot: slot,
                            };
                            let _ = tx.send((conn, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "metrics: TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "metrics: TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self {
            ready,
            local,
            accepting,
        })
    }
}

impl Drop for MetricsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for MetricsListener {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(ready) => ready,
            // The accepting task owns a sender for as long as it runs, and
            // it runs until this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}
