//! The floor under every kvtier call: a bare tonic server answering a unary
//! echo (default settings, no gate, no store), on its own runtime as a
//! server would be. An empty kvtier call is measured against it in the same
//! run, and a fetch against the echo answering with as many bytes.

use std::sync::{Mutex, PoisonError};

use anyhow::Context;
use bytes::Bytes;
use kvtier_proto::bench::EchoMessage;
use kvtier_proto::bench::echo_client::EchoClient;
use kvtier_proto::bench::echo_server::{Echo, EchoServer};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

/// The most bytes one reply may ask for.
const MAX_REPLY_BYTES: u64 = 64 << 20;

#[derive(Debug, Default)]
struct Echoer {
    /// Written once to the largest size asked for (so its pages are its
    /// own, not the kernel's shared zero page), then sliced for replies.
    written: Mutex<Bytes>,
}

impl Echoer {
    fn bytes(&self, n: u64) -> Result<Bytes, Status> {
        if n > MAX_REPLY_BYTES {
            return Err(Status::invalid_argument(format!(
                "reply_bytes: {n} is over the most one reply may ask for, {MAX_REPLY_BYTES}"
            )));
        }
        let n = n as usize;
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        if written.len() < n {
            *written = Bytes::from(vec![0xa5; n]);
        }
        Ok(written.slice(..n))
    }
}

#[tonic::async_trait]
impl Echo for Echoer {
    async fn echo(&self, request: Request<EchoMessage>) -> Result<Response<EchoMessage>, Status> {
        let message = request.into_inner();
        if message.reply_bytes == 0 {
            return Ok(Response::new(message));
        }
        Ok(Response::new(EchoMessage {
            payload: self.bytes(message.reply_bytes)?,
            reply_bytes: 0,
        }))
    }
}

/// A running echo server; stops when dropped.
#[derive(Debug)]
pub(crate) struct EchoServerHandle {
    pub(crate) addr: std::net::SocketAddr,
    running: Running,
}

#[derive(Debug)]
enum Running {
    InProcess {
        _stop: oneshot::Sender<()>,
        _thread: std::thread::JoinHandle<()>,
    },
    Child(std::process::Child),
    /// Started by someone else (`--echo`), who also stops it.
    Elsewhere,
}

impl Drop for EchoServerHandle {
    fn drop(&mut self) {
        if let Running::Child(child) = &mut self.running {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct EchoArgs {
    /// Where to listen (port 0: any free one; the address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: std::net::SocketAddr,
}

/// Binds the echo server on a runtime of its own (two workers, like
/// `kvtier serve` on this machine's cores).
fn bind(addr: std::net::SocketAddr) -> anyhow::Result<(tokio::runtime::Runtime, tokio::net::TcpListener)> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind(addr))?;
    Ok((runtime, listener))
}

fn serve_on(
    runtime: &tokio::runtime::Runtime,
    listener: tokio::net::TcpListener,
    stop: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    // What `Server::serve` would accept with: a stream from a listener
    // sets no TCP_NODELAY, and Nagle then holds a reply's last write for
    // the peer's delayed ACK (40 ms).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let serve = tonic::transport::Server::builder()
        .add_service(EchoServer::new(Echoer::default()))
        .serve_with_incoming_shutdown(incoming, stop);
    Ok(runtime.block_on(serve)?)
}

/// An echo server in this process, for an in-process kvtier server.
pub(crate) fn start() -> anyhow::Result<EchoServerHandle> {
    let (runtime, listener) = bind(([127, 0, 0, 1], 0).into())?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new().name("echo-server".into()).spawn(move || {
        let stop = async {
            let _ = stopped.await;
        };
        if let Err(e) = serve_on(&runtime, listener, stop) {
            tracing::warn!(error = %e, "echo server failed");
        }
    })?;
    Ok(EchoServerHandle {
        addr,
        running: Running::InProcess {
            _stop: stop,
            _thread: thread,
        },
    })
}

/// An echo server in a process of its own (`kvtier bench echo`), as a
/// kvtier server at `--addr` is: the floor then pays what the server does.
pub(crate) fn start_process() -> anyhow::Result<EchoServerHandle> {
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["bench", "echo"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the echo server process")?;
    let stdout = child.stdout.take().context("the echo server's stdout")?;
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("the echo server said {line:?}"))?;
    Ok(EchoServerHandle {
        addr,
        running: Running::Child(child),
    })
}

/// An echo server already running at `addr` (`kvtier bench echo`, placed
/// on the CPUs the other servers run on).
pub(crate) fn running_at(addr: std::net::SocketAddr) -> EchoServerHandle {
    EchoServerHandle {
        addr,
        running: Running::Elsewhere,
    }
}

/// `kvtier bench echo`: serves the echo until stdin closes (its parent
/// ended) or it is killed; prints the address it listens on first.
pub(crate) fn run(args: EchoArgs) -> anyhow::Result<()> {
    let (runtime, listener) = bind(args.listen)?;
    println!("listening on {}", listener.local_addr()?);
    let (closed, stop) = oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::Read::read(&mut std::io::stdin(), &mut [0u8; 1]);
        let _ = closed.send(());
    });
    serve_on(&runtime, listener, async {
        let _ = stop.await;
    })
}

/// A tonic client of the echo server, with kvtier's client's HTTP/2
/// settings (`Client::endpoint`), so a reply of many bytes travels as a
/// fetch's does.
pub(crate) async fn client(server: &EchoServerHandle) -> anyhow::Result<EchoClient<tonic::transport::Channel>> {
    let endpoint = kvtier_client::Client::endpoint(format!("http://{}", server.addr))?;
    let channel = endpoint.connect().await.context("connecting to the echo server")?;
    Ok(EchoClient::new(channel).max_decoding_message_size(MAX_REPLY_BYTES as usize))
}

/// One echo asking for `reply_bytes` (0: an empty one): the bytes it
/// answered.
pub(crate) async fn call(client: &mut EchoClient<tonic::transport::Channel>, reply_bytes: u64) -> anyhow::Result<u64> {
    let reply = client
        .echo(EchoMessage {
            payload: Bytes::new(),
            reply_bytes,
        })
        .await?;
    Ok(reply.into_inner().payload.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_the_bytes_asked_for_and_too_many_are_refused_by_name() {
        let echoer = Echoer::default();
        assert_eq!(echoer.bytes(3).unwrap().len(), 3);
        let grown = echoer.bytes(1 << 20).unwrap();
        assert_eq!(grown.len(), 1 << 20);
        assert!(grown.iter().all(|&b| b == 0xa5), "written, not the zero page");
        assert_eq!(echoer.bytes(5).unwrap().len(), 5);
        assert_eq!(
            echoer.bytes(MAX_REPLY_BYTES + 1).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        assert!(
            echoer
                .bytes(u64::MAX)
                .unwrap_err()
                .message()
                .starts_with("reply_bytes: ")
        );
    }
}
