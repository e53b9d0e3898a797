//! The floor under every kvtier call: a bare tonic server answering a unary
//! echo (default settings, no gate, no store), on its own runtime as a
//! server would be, called through a stock tonic channel. An empty kvtier
//! call is measured against it in the same run.

use std::time::Instant;

use anyhow::Context;
use kvtier_proto::bench::EchoMessage;
use kvtier_proto::bench::echo_client::EchoClient;
use kvtier_proto::bench::echo_server::{Echo, EchoServer};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

#[derive(Debug)]
struct Echoer;

#[tonic::async_trait]
impl Echo for Echoer {
    async fn echo(&self, request: Request<EchoMessage>) -> Result<Response<EchoMessage>, Status> {
        Ok(Response::new(request.into_inner()))
    }
}

/// A running echo server; stops when dropped.
#[derive(Debug)]
pub(crate) struct EchoServerHandle {
    pub(crate) addr: std::net::SocketAddr,
    _stop: oneshot::Sender<()>,
    _thread: std::thread::JoinHandle<()>,
}

/// Starts the echo server on a runtime of its own (two workers, like
/// `kvtier serve` on this machine's cores).
pub(crate) fn start() -> anyhow::Result<EchoServerHandle> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new().name("echo-server".into()).spawn(move || {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let serve = tonic::transport::Server::builder()
            .add_service(EchoServer::new(Echoer))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            });
        if let Err(e) = runtime.block_on(serve) {
            tracing::warn!(error = %e, "echo server failed");
        }
    })?;
    Ok(EchoServerHandle {
        addr,
        _stop: stop,
        _thread: thread,
    })
}

/// A stock tonic client of the echo server.
pub(crate) async fn client(server: &EchoServerHandle) -> anyhow::Result<EchoClient<tonic::transport::Channel>> {
    EchoClient::connect(format!("http://{}", server.addr))
        .await
        .context("connecting to the echo server")
}

/// One empty echo; its latency in µs.
pub(crate) async fn call(client: &mut EchoClient<tonic::transport::Channel>) -> anyhow::Result<u64> {
    let t = Instant::now();
    client.echo(EchoMessage::default()).await?;
    Ok(t.elapsed().as_micros() as u64)
}
