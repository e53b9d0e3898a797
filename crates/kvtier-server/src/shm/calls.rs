//! Calls over a registered connection (`kvtier.v1.LocalCall`): each
//! connection gets a thread that reads a call, runs it straight into the
//! store and writes the reply. On these machines every wake-up of a parked
//! thread costs tens of microseconds, and a gRPC call pays several (HTTP/2
//! connection task, handler task, blocking pool); here a call pays the one
//! that delivers its frame.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use kvtier_core::wire;
use kvtier_proto::v1 as pb;
use prost::Message;
use tonic::{Code, Status};

use super::Regions;
use crate::auth::Caller;
use crate::inflight::InFlight;
use crate::rpc_metrics::{RpcMetrics, Transport};
use crate::status::invalid;

/// The store calls a connection may make: the gRPC calls' own checks and
/// work, without their transport.
pub(crate) trait LocalCalls: Send + Sync + 'static {
    fn fetch_pages(&self, caller: &Caller, r: pb::FetchPagesRequest) -> Result<Vec<pb::FetchPagesResponse>, Status>;
    fn select_pages(&self, caller: &Caller, r: pb::SelectPagesRequest) -> Result<Vec<pb::SelectPagesResponse>, Status>;
    fn append_tokens(&self, caller: &Caller, r: pb::AppendTokensRequest) -> Result<pb::AppendTokensResponse, Status>;
}

/// What every connection's thread shares.
#[derive(Clone)]
pub(crate) struct CallContext {
    pub(crate) calls: Arc<dyn LocalCalls>,
    pub(crate) regions: Arc<Regions>,
    pub(crate) in_flight: Arc<InFlight>,
    pub(crate) metrics: Arc<RpcMetrics>,
    /// The largest call frame accepted: the server's message limit.
    pub(crate) max_frame: usize,
}

impl std::fmt::Debug for CallContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallContext")
            .field("max_frame", &self.max_frame)
            .finish()
    }
}

/// The registered connections' threads, so that a stopping server can end
/// them (and with them their hold on the store).
#[derive(Debug, Default)]
pub(crate) struct Connections {
    open: Mutex<HashMap<u64, (UnixStream, JoinHandle<()>)>>,
}

impl Connections {
    fn open(&self) -> MutexGuard<'_, HashMap<u64, (UnixStream, JoinHandle<()>)>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serves region `id`'s connection on a thread of its own until the
    /// client closes it (or the server stops); the region goes with it.
    pub(crate) fn start(
        self: &Arc<Self>,
        id: u64,
        stream: UnixStream,
        caller: Caller,
        ctx: CallContext,
    ) -> io::Result<()> {
        let shutter = stream.try_clone()?;
        let connections = Arc::clone(self);
        // Registered before the thread can end and deregister itself.
        let mut open = self.open();
        let thread = std::thread::Builder::new()
            .name(format!("kvtier-shm-{:04x}", id & 0xffff))
            .spawn(move || {
                // The region goes when the thread ends, however it ends.
                let _release = Release {
                    id,
                    regions: Arc::clone(&ctx.regions),
                    connections,
                };
                if let Err(e) = serve(&stream, &caller, &ctx) {
                    tracing::debug!(region = id, error = %e, "shm connection failed");
                }
            })?;
        open.insert(id, (shutter, thread));
        Ok(())
    }

    /// Ends every connection: calls running finish, and their threads are
    /// joined.
    pub(crate) fn close_all(&self) {
        let open: Vec<_> = self.open().drain().map(|(_, c)| c).collect();
        for (stream, thread) in open {
            let _ = stream.shutdown(Shutdown::Both);
            let _ = thread.join();
        }
    }
}

/// Gives a connection's region up, and its entry among the open ones.
struct Release {
    id: u64,
    regions: Arc<Regions>,
    connections: Arc<Connections>,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.regions.remove(self.id);
        self.connections.open().remove(&self.id);
        tracing::debug!(region = self.id, "shm region released");
    }
}

/// Reads calls and answers them until the client closes the connection.
fn serve(mut stream: &UnixStream, caller: &Caller, ctx: &CallContext) -> io::Result<()> {
    loop {
        let mut len = [0u8; 4];
        match stream.read_exact(&mut len) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            read => read?,
        }
        let len = u32::from_le_bytes(len) as usize;
        let start = Instant::now();
        let (method, reply) = match read_call(stream, len, ctx)? {
            Ok(call) => answer(call, caller, ctx),
            Err(status) => (None, Err(status)),
        };
        let code = reply.as_ref().err().map_or(Code::Ok, Status::code);
        write_reply(stream, reply)?;
        if let Some(method) = method {
            ctx.metrics.record_named(Transport::ShmSocket, method, code, start);
        }
    }
}

/// A call's frame, decoded; a frame over the limit or without room in
/// flight is skipped and refused.
fn read_call(mut stream: &UnixStream, len: usize, ctx: &CallContext) -> io::Result<Result<pb::LocalCall, Status>> {
    let refused = |status| {
        io::copy(&mut stream.take(len as u64), &mut io::sink())?;
        Ok(Err(status))
    };
    if len > ctx.max_frame {
        return refused(Status::resource_exhausted(format!(
            "the call is {len} bytes; the server accepts at most {}",
            ctx.max_frame
        )));
    }
    let _held = match ctx.in_flight.try_hold(len) {
        Ok(held) => held,
        Err(status) => return refused(status),
    };
    let mut frame = vec![0u8; len];
    stream.read_exact(&mut frame)?;
    Ok(pb::LocalCall::decode(frame.as_slice())
        .map_err(|e| Status::invalid_argument(format!("the call is not a kvtier.v1.LocalCall: {e}"))))
}

/// Runs a call; the method it named, and its reply.
fn answer(
    call: pb::LocalCall,
    caller: &Caller,
    ctx: &CallContext,
) -> (Option<&'static str>, Result<pb::LocalReply, Status>) {
    use pb::local_call::Call;
    match call.call {
        Some(Call::FetchPages(r)) => (
            Some("FetchPages"),
            ctx.calls.fetch_pages(caller, r).map(|fetch_pages| pb::LocalReply {
                fetch_pages,
                ..Default::default()
            }),
        ),
        Some(Call::SelectPages(r)) => (
            Some("SelectPages"),
            ctx.calls.select_pages(caller, r).map(|select_pages| pb::LocalReply {
                select_pages,
                ..Default::default()
            }),
        ),
        Some(Call::AppendTokens(r)) => (
            Some("AppendTokens"),
            ctx.calls.append_tokens(caller, r).map(|append_tokens| pb::LocalReply {
                append_tokens: Some(append_tokens),
                ..Default::default()
            }),
        ),
        None => (None, Err(invalid(wire::LOCAL_CALL, "names no call"))),
    }
}

fn write_reply(mut stream: &UnixStream, reply: Result<pb::LocalReply, Status>) -> io::Result<()> {
    let reply = reply.unwrap_or_else(|status| pb::LocalReply {
        error: Some(pb::LocalError {
            code: status.code() as i32,
            message: status.message().to_owned(),
        }),
        ..Default::default()
    });
    let len = reply.encoded_len();
    let header = u32::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a reply over 4 GiB"))?
        .to_le_bytes();
    let mut frame = Vec::with_capacity(4 + len);
    frame.extend_from_slice(&header);
    reply.encode(&mut frame).map_err(io::Error::other)?;
    stream.write_all(&frame)
}

#[cfg(test)]
mod tests {
    use kvtier_store::{Store, StoreConfig};

    use super::*;
    use crate::auth::Auth;
    use crate::service::{KvTierService, TraceSettings};

    /// A connection's thread over a real store, the far end of a socket
    /// pair for the test to write frames to.
    fn connection(max_frame: usize) -> (UnixStream, std::thread::JoinHandle<io::Result<()>>) {
        let store = Store::new(StoreConfig {
            device_bytes: 0,
            host_bytes: 1 << 20,
            ..StoreConfig::default()
        })
        .unwrap();
        let regions = Arc::new(Regions::default());
        let in_flight = InFlight::new(1 << 20);
        let traces = TraceSettings {
            dir: None,
            max_bytes: 0,
        };
        let service = KvTierService::new(store, 1 << 20, Arc::clone(&in_flight), Arc::clone(&regions), traces);
        let ctx = CallContext {
            calls: Arc::new(service),
            regions,
            in_flight,
            metrics: Arc::new(RpcMetrics::default()),
            max_frame,
        };
        let caller = Auth::default().caller_with_token("").unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        (ours, std::thread::spawn(move || serve(&theirs, &caller, &ctx)))
    }

    fn send(mut stream: &UnixStream, body: &[u8]) {
        stream.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
        stream.write_all(body).unwrap();
    }

    fn reply(mut stream: &UnixStream) -> pb::LocalReply {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        stream.read_exact(&mut body).unwrap();
        pb::LocalReply::decode(body.as_slice()).unwrap()
    }

    fn refusal(stream: &UnixStream) -> (Code, String) {
        let e = reply(stream).error.expect("a refusal");
        (Code::from_i32(e.code), e.message)
    }

    #[test]
    fn bad_frames_are_refused_and_the_connection_goes_on() {
        let (stream, thread) = connection(64);
        // Not a LocalCall (a field of wire type 7 does not exist).
        send(&stream, &[0x0f, 1, 2, 3]);
        let (code, message) = refusal(&stream);
        assert_eq!(code, Code::InvalidArgument, "{message}");
        assert!(message.contains("not a kvtier.v1.LocalCall"), "{message}");
        // Longer than the limit: skipped whole, whatever it holds.
        send(&stream, &[0xff; 100]);
        let (code, message) = refusal(&stream);
        assert_eq!(code, Code::ResourceExhausted, "{message}");
        // No call at all.
        send(&stream, &[]);
        let (code, message) = refusal(&stream);
        assert_eq!((code, message.as_str()), (Code::InvalidArgument, "call: names no call"));
        // A real call, for a sequence that does not exist: the stream is
        // still in step.
        let call = pb::LocalCall {
            call: Some(pb::local_call::Call::FetchPages(pb::FetchPagesRequest {
                sequence_id: "nope".into(),
                kv_head_count: 1,
                ..Default::default()
            })),
        };
        send(&stream, &call.encode_to_vec());
        let (code, message) = refusal(&stream);
        assert_eq!(code, Code::NotFound, "{message}");
        // A frame cut short by the client's end: the thread ends, cleanly
        // or with the read's error, and never answers half a call.
        (&stream).write_all(&[10, 0, 0, 0, 1]).unwrap();
        drop(stream);
        assert!(thread.join().unwrap().is_err());
    }
}
