//! Calls over a registered connection (`kvtier.v1.LocalCall`): each
//! connection gets a thread that reads a call, runs it straight into the
//! store and writes the reply. On these machines every wake-up of a parked
//! thread costs tens of microseconds, and a gRPC call pays several (HTTP/2
//! connection task, handler task, blocking pool); here a call pays the one
//! that delivers its frame, and not even that where calls come back to
//! back: the thread polls for the next one first.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtier_core::poll::AdaptivePoll;
use kvtier_core::wire;
use kvtier_proto::v1 as pb;
use kvtier_sync::{Mutex, MutexGuard, Rank};
use prost::Message;
use tonic::{Code, Status};

use super::Regions;
use super::long_polls::{LongPoll, LongPolls};
use crate::auth::Caller;
use crate::inflight::{Held, InFlight};
use crate::rpc_metrics::{RpcMetrics, Transport};
use crate::status::invalid;

/// The store calls a connection may make: the gRPC calls' own checks and
/// work, without their transport.
pub(crate) trait LocalCalls: std::fmt::Debug + Send + Sync + 'static {
    fn fetch_pages(&self, caller: &Caller, r: pb::FetchPagesRequest) -> Result<Vec<pb::FetchPagesResponse>, Status>;
    fn select_pages(&self, caller: &Caller, r: pb::SelectPagesRequest) -> Result<Vec<pb::SelectPagesResponse>, Status>;
    fn append_tokens(&self, caller: &Caller, r: pb::AppendTokensRequest) -> Result<pb::AppendTokensResponse, Status>;
    /// After an answered selection `r` (its fields but the bytes): warms
    /// what the decode loop's next call, the next layer's, reads first.
    fn warm_after(&self, caller: &Caller, r: &pb::SelectPagesRequest);
}

/// What every connection's thread shares.
#[derive(Debug, Clone)]
pub(crate) struct CallContext {
    pub(crate) calls: Arc<dyn LocalCalls>,
    pub(crate) regions: Arc<Regions>,
    pub(crate) in_flight: Arc<InFlight>,
    pub(crate) metrics: Arc<RpcMetrics>,
    /// The largest call frame accepted: the server's message limit.
    pub(crate) max_frame: usize,
    /// How long a connection's thread polls for its next call at most
    /// before sleeping on it (`ServerConfig::shm_poll`), unless a call asks
    /// for another after it.
    pub(crate) poll: Duration,
    /// The longest poll a call may ask for (`ServerConfig::shm_poll_max`;
    /// zero: calls cannot ask).
    pub(crate) poll_max: Duration,
    /// Who may poll longer than `poll`.
    pub(crate) long_polls: Arc<LongPolls>,
}

/// The registered connections' threads, so that a stopping server can end
/// them (and with them their hold on the store).
#[derive(Debug)]
pub(crate) struct Connections {
    open: Mutex<Open>,
}

impl Default for Connections {
    fn default() -> Self {
        Self {
            open: Mutex::new(Rank::ShmConnections, Open::default()),
        }
    }
}

#[derive(Debug, Default)]
struct Open {
    /// Set when the server stops: no connection starts after.
    closed: bool,
    threads: HashMap<u64, (UnixStream, JoinHandle<()>)>,
}

impl Connections {
    fn open(&self) -> MutexGuard<'_, Open> {
        self.open.lock()
    }

    /// Serves region `id`'s connection on a thread of its own until the
    /// client closes it (or the server stops); the region goes with it.
    /// Refused once the server is stopping (a registration that finished
    /// late), and the caller gives the region up.
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
        if open.closed {
            return Err(io::Error::other("the server is stopping"));
        }
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
        open.threads.insert(id, (shutter, thread));
        Ok(())
    }

    /// Ends every connection and lets none start: calls running finish,
    /// and their threads are joined.
    pub(crate) fn close_all(&self) {
        let open: Vec<_> = {
            let mut open = self.open();
            open.closed = true;
            open.threads.drain().map(|(_, c)| c).collect()
        };
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
        self.connections.open().threads.remove(&self.id);
        tracing::debug!(region = self.id, "shm region released");
    }
}

/// How long the rest of a call's frame may take once its length has
/// arrived, and a reply's write: a client that stalls mid-frame, or never
/// reads, loses its connection rather than holding the thread.
const FRAME_TIME: Duration = Duration::from_secs(10);

/// A frame's bytes are read, and charged in flight, this many at a time:
/// a frame's announced length claims nothing until its bytes arrive.
const PIECE: usize = 64 << 10;

/// Reads calls and answers them until the client closes the connection.
fn serve(stream: &UnixStream, caller: &Caller, ctx: &CallContext) -> io::Result<()> {
    // Set once: resetting the read timeout around every call's length cost
    // two system calls a call.
    stream.set_write_timeout(Some(FRAME_TIME))?;
    stream.set_read_timeout(Some(FRAME_TIME))?;
    let mut poll = AdaptivePoll::new(ctx.poll);
    // Held while this thread may poll longer than the server's own poll.
    let mut long: Option<LongPoll> = None;
    while let Some(len) = next_len(stream, &mut poll, &mut long)? {
        let start = Instant::now();
        // The call's bytes stay charged until its reply is written.
        let (_held, call) = read_call(stream, len, ctx)?;
        let mut warm = None;
        let (method, reply) = match call {
            Ok(call) => {
                if let Some(pb::local_call::Call::SelectPages(r)) = &call.call {
                    warm = Some(pb::SelectPagesRequest {
                        queries: Default::default(),
                        append: None,
                        tenant: r.tenant.clone(),
                        sequence_id: r.sequence_id.clone(),
                        ..*r
                    });
                }
                let asked = asked_poll(call.poll_next_us, ctx.poll_max);
                let (method, reply) = answer(call, caller, ctx);
                // A refused call changes nothing, its ask included.
                if reply.is_ok() {
                    poll.set_cap(next_poll(asked, ctx, &mut long));
                }
                (method, reply)
            }
            Err(status) => (None, Err(status)),
        };
        let code = reply.as_ref().err().map_or(Code::Ok, Status::code);
        ctx.metrics
            .record_named(Transport::ShmSocket, method.unwrap_or("unknown"), code, start);
        let ok = code == Code::Ok;
        write_reply(stream, reply)?;
        if let (true, Some(r)) = (ok, &warm) {
            ctx.calls.warm_after(caller, r);
        }
    }
    Ok(())
}

/// The poll for the next call after an answered call that asked for
/// `asked`: the server's own when it asked nothing, the ask when shorter,
/// and when longer the ask while this thread holds one of the server's
/// long-poll slots (`long`, taken here when free), else the server's own.
fn next_poll(asked: Option<Duration>, ctx: &CallContext, long: &mut Option<LongPoll>) -> Duration {
    match asked {
        Some(asked) if asked > ctx.poll => {
            if long.is_none() {
                *long = ctx.long_polls.try_take();
            }
            if long.is_some() { asked } else { ctx.poll }
        }
        asked => {
            *long = None;
            asked.unwrap_or(ctx.poll)
        }
    }
}

/// The poll for the next call a call's `poll_next_us` asks for, cut to
/// `max`: `None` where it asks nothing (the server's own poll), or where
/// `max` is zero (calls cannot ask).
fn asked_poll(poll_next_us: u32, max: Duration) -> Option<Duration> {
    (poll_next_us > 0 && !max.is_zero()).then(|| Duration::from_micros(poll_next_us.into()).min(max))
}

/// The next call's length; `None` once the client has closed. Polled for
/// first while `poll` says so: a worker's calls often come back to back,
/// and a thread that sleeps between them is woken tens of microseconds
/// after each arrives (an smollm2 fetch over a region: 38 -> 17 us at p50
/// with this poll). Between calls a client may wait as long as it likes:
/// the read timeout only wakes this to wait again. A thread that sleeps
/// gives its long-poll slot (`long`) back: it polls no more.
fn next_len(
    mut stream: &UnixStream,
    poll: &mut AdaptivePoll,
    long: &mut Option<LongPoll>,
) -> io::Result<Option<usize>> {
    let waiting = Instant::now();
    let mut len = [0u8; 4];
    let fd = stream.as_raw_fd();
    let polled = poll.poll(|| {
        // SAFETY: `len` is valid for writes of its length, and `fd` is the
        // connection's, open while `stream` is borrowed.
        let n = unsafe { libc::recv(fd, len.as_mut_ptr().cast(), len.len(), libc::MSG_DONTWAIT) };
        match n {
            n if n >= 0 => Ok(Some(n as usize)),
            _ => match io::Error::last_os_error() {
                e if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                e => Err(e),
            },
        }
    })?;
    if polled.is_none() {
        *long = None;
    }
    let mut have = match polled {
        Some(0) => return Ok(None),
        Some(n) => n,
        None => 0,
    };
    while have < len.len() {
        match stream.read(&mut len[have..]) {
            Ok(0) => return Ok(None),
            Ok(n) => have += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    poll.observe(waiting.elapsed());
    Ok(Some(u32::from_le_bytes(len) as usize))
}

/// A call's frame, decoded, with the in-flight bytes it holds; a frame over
/// the limit, or one the in-flight bytes have no room for, is skipped and
/// refused.
fn read_call(
    mut stream: &UnixStream,
    len: usize,
    ctx: &CallContext,
) -> io::Result<(Option<Held>, Result<pb::LocalCall, Status>)> {
    let skip = |rest: usize| io::copy(&mut stream.take(rest as u64), &mut io::sink());
    if len > ctx.max_frame {
        skip(len)?;
        let status = Status::resource_exhausted(format!(
            "the call is {len} bytes; the server accepts at most {}",
            ctx.max_frame
        ));
        return Ok((None, Err(status)));
    }
    let mut frame = Vec::new();
    let mut held: Option<Held> = None;
    while frame.len() < len {
        let n = PIECE.min(len - frame.len());
        match ctx.in_flight.try_hold(n) {
            Ok(more) => match held.as_mut() {
                Some(h) => h.merge(more),
                None => held = Some(more),
            },
            Err(status) => {
                skip(len - frame.len())?;
                return Ok((None, Err(status)));
            }
        }
        let at = frame.len();
        frame.resize(at + n, 0);
        stream.read_exact(&mut frame[at..])?;
    }
    let call = pb::LocalCall::decode(frame.as_slice())
        .map_err(|e| Status::invalid_argument(format!("the call is not a kvtier.v1.LocalCall: {e}")));
    Ok((held, call))
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

fn write_reply(stream: &UnixStream, reply: Result<pb::LocalReply, Status>) -> io::Result<()> {
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
    send_all(stream, &frame)
}

/// Writes all of `bytes`, without SIGPIPE when the client has gone (a
/// process embedding the server may not ignore it).
fn send_all(stream: &UnixStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: `bytes` is valid for reading its length, and the
        // descriptor is the stream's, open while `stream` is borrowed.
        let sent = unsafe {
            libc::send(
                stream.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if sent < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        bytes = &bytes[sent as usize..];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use kvtier_store::{Store, StoreConfig};

    use super::*;
    use crate::auth::Auth;
    use crate::service::{KvTierService, TraceSettings};

    /// A connection's thread over a real store, the far end of a socket
    /// pair for the test to write frames to, and the server's in-flight
    /// bytes.
    fn connection(max_frame: usize) -> (UnixStream, std::thread::JoinHandle<io::Result<()>>, Arc<InFlight>) {
        polling_connection(
            max_frame,
            crate::DEFAULT_SHM_POLL,
            crate::DEFAULT_SHM_POLL_MAX,
            LongPolls::new(1),
        )
    }

    /// [`connection`], its thread polling for calls for up to `poll`, and
    /// longer as its calls ask (up to `poll_max`) while it holds one of
    /// `long_polls`. The store holds sequence `s` (default tenant): one
    /// layer, one KV head of 4 dimensions, f32.
    fn polling_connection(
        max_frame: usize,
        poll: Duration,
        poll_max: Duration,
        long_polls: Arc<LongPolls>,
    ) -> (UnixStream, std::thread::JoinHandle<io::Result<()>>, Arc<InFlight>) {
        let store = Store::new(StoreConfig {
            device_bytes: 0,
            host_bytes: 1 << 20,
            ..StoreConfig::default()
        })
        .unwrap();
        let layout = kvtier_core::Layout::new(kvtier_core::LayoutSpec {
            num_layers: 1,
            num_kv_heads: 1,
            num_query_heads: 1,
            head_dim: 4,
            dtype: kvtier_core::DType::F32,
            page_size: 4,
            layer_groups: Vec::new(),
        })
        .unwrap();
        store
            .create_sequence(kvtier_core::SequenceKey::parse("", "s").unwrap(), layout, Vec::new())
            .unwrap();
        let regions = Arc::new(Regions::default());
        let in_flight = InFlight::new(1 << 20);
        let traces = TraceSettings {
            dir: None,
            max_bytes: 0,
        };
        let service = KvTierService::new(
            store,
            1 << 20,
            Arc::clone(&in_flight),
            Arc::clone(&regions),
            traces,
            None,
        );
        let ctx = CallContext {
            calls: Arc::new(service),
            regions,
            in_flight: Arc::clone(&in_flight),
            metrics: Arc::new(RpcMetrics::default()),
            max_frame,
            poll,
            poll_max,
            long_polls,
        };
        let caller = Auth::default().caller_with_token("").unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        (
            ours,
            std::thread::spawn(move || serve(&theirs, &caller, &ctx)),
            in_flight,
        )
    }

    fn send(mut stream: &UnixStream, body: &[u8]) {
        use std::io::Write;
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
        let (stream, thread, _) = connection(64);
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
            ..Default::default()
        };
        send(&stream, &call.encode_to_vec());
        let (code, message) = refusal(&stream);
        assert_eq!(code, Code::NotFound, "{message}");
        // A frame cut short by the client's end: the thread ends, cleanly
        // or with the read's error, and never answers half a call.
        std::io::Write::write_all(&mut &stream, &[10, 0, 0, 0, 1]).unwrap();
        drop(stream);
        assert!(thread.join().unwrap().is_err());
    }

    /// An append of one token to `s`, asking for a poll of `poll_next_us`.
    fn append_asking(poll_next_us: u32) -> Vec<u8> {
        pb::LocalCall {
            call: Some(pb::local_call::Call::AppendTokens(pb::AppendTokensRequest {
                sequence_id: "s".into(),
                kv_head_count: 1,
                num_tokens: 1,
                kv: vec![0u8; 2 * 4 * 4].into(),
                ..Default::default()
            })),
            poll_next_us,
        }
        .encode_to_vec()
    }

    #[test]
    fn answered_calls_that_ask_poll_long_while_a_slot_is_free() {
        // Polls asked for last a minute: no slot is given back meanwhile,
        // however slowly this test runs.
        const LONG: u32 = 60_000_000;
        let slots = LongPolls::new(1);
        let (stream, thread, _) = polling_connection(
            1 << 20,
            crate::DEFAULT_SHM_POLL,
            Duration::from_secs(60),
            Arc::clone(&slots),
        );
        // A refused call's ask changes nothing.
        let mut refused = pb::LocalCall::decode(missing_fetch().as_slice()).unwrap();
        refused.poll_next_us = LONG;
        send(&stream, &refused.encode_to_vec());
        assert_eq!(refusal(&stream).0, Code::NotFound);
        assert_eq!(slots.held(), 0, "a refused call took a slot");
        // Answered, asking past the server's own poll: the slot is taken
        // before the reply is written.
        send(&stream, &append_asking(LONG));
        assert!(reply(&stream).error.is_none());
        assert_eq!(slots.held(), 1);
        // The next call asks nothing: the server's own poll, the slot back.
        send(&stream, &append_asking(0));
        assert!(reply(&stream).error.is_none());
        assert_eq!(slots.held(), 0);
        // Asking within the server's own poll needs no slot.
        send(&stream, &append_asking(10));
        assert!(reply(&stream).error.is_none());
        assert_eq!(slots.held(), 0);
        // A slot taken by someone else: this thread polls its own.
        let elsewhere = slots.try_take().unwrap();
        send(&stream, &append_asking(LONG));
        assert!(reply(&stream).error.is_none());
        assert_eq!(slots.held(), 1, "took a slot that was not free");
        drop(elsewhere);
        send(&stream, &append_asking(LONG));
        assert!(reply(&stream).error.is_none());
        assert_eq!(slots.held(), 1, "a free slot is taken by the next ask");
        // The connection ends, polling: its slot with it.
        drop(stream);
        thread.join().unwrap().unwrap();
        assert_eq!(slots.held(), 0);
    }

    #[test]
    fn a_thread_gives_its_slot_back_when_it_sleeps() {
        let slots = LongPolls::new(1);
        let (stream, thread, _) = polling_connection(
            1 << 20,
            crate::DEFAULT_SHM_POLL,
            crate::DEFAULT_SHM_POLL_MAX,
            Arc::clone(&slots),
        );
        // Asks for 1 ms, then no call comes: past its poll the thread
        // sleeps and gives the slot back.
        send(&stream, &append_asking(1000));
        assert!(reply(&stream).error.is_none());
        let given_back = Instant::now();
        while slots.held() > 0 {
            assert!(
                given_back.elapsed() < Duration::from_secs(10),
                "a sleeping thread kept its slot"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(stream);
        thread.join().unwrap().unwrap();
    }

    #[test]
    fn a_call_asks_for_a_poll_up_to_the_servers_longest() {
        let max = Duration::from_millis(10);
        assert_eq!(asked_poll(0, max), None, "asks nothing");
        assert_eq!(asked_poll(3000, max), Some(Duration::from_millis(3)));
        assert_eq!(asked_poll(u32::MAX, max), Some(max), "cut to the longest");
        assert_eq!(asked_poll(3000, Duration::ZERO), None, "a server that takes no asks");
    }

    #[test]
    fn an_announced_frame_claims_in_flight_bytes_only_as_they_arrive() {
        // Requests may hold 512 KiB in flight; the frame announces 400 KiB
        // and sends 10 bytes, then stalls.
        let (stream, thread, in_flight) = connection(1 << 20);
        std::io::Write::write_all(&mut &stream, &(400u32 << 10).to_le_bytes()).unwrap();
        std::io::Write::write_all(&mut &stream, &[0u8; 10]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        // Everyone else still has room for as much: the stall holds one piece.
        let others = in_flight.try_hold(400 << 10);
        assert!(others.is_ok(), "a stalled frame holds the room its length announced");
        drop(others);
        drop(stream);
        assert!(thread.join().unwrap().is_err());
    }

    /// A call for a sequence that does not exist: refused NOT_FOUND.
    fn missing_fetch() -> Vec<u8> {
        pb::LocalCall {
            call: Some(pb::local_call::Call::FetchPages(pb::FetchPagesRequest {
                sequence_id: "nope".into(),
                kv_head_count: 1,
                ..Default::default()
            })),
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn a_calls_length_is_read_whole_however_it_arrives_polled_for_or_slept_on() {
        use std::io::Write;
        let body = missing_fetch();
        let len = (body.len() as u32).to_le_bytes();
        // Where the length is cut, and how long each piece waits: within
        // the poll, past it, and none (a thread that never polls).
        for poll in [Duration::ZERO, Duration::from_millis(5)] {
            let (stream, thread, _) = polling_connection(1 << 20, poll, crate::DEFAULT_SHM_POLL_MAX, LongPolls::new(1));
            for cut in 1..4 {
                for pause in [Duration::ZERO, Duration::from_micros(200), Duration::from_millis(20)] {
                    std::thread::sleep(pause);
                    (&stream).write_all(&len[..cut]).unwrap();
                    std::thread::sleep(pause);
                    (&stream).write_all(&len[cut..]).unwrap();
                    (&stream).write_all(&body).unwrap();
                    let (code, message) = refusal(&stream);
                    assert_eq!(
                        code,
                        Code::NotFound,
                        "cut {cut}, pause {pause:?}, poll {poll:?}: {message}"
                    );
                }
            }
            // Closed while the thread polls or sleeps: it ends cleanly.
            std::thread::sleep(Duration::from_millis(1));
            drop(stream);
            thread.join().unwrap().unwrap();
        }
    }
}
