//! What every `kvtier.v1` call passes before tonic decodes it: the caller's
//! token, resolved to what it may touch, and the request's gRPC framing,
//! checked as the bytes arrive.
//!
//! tonic checks a message's length only once it has the header, and reports
//! an oversized one as OUT_OF_RANGE, a malformed body (a bad flag byte, a
//! body that ends inside a message, a unary call without a message) as
//! INTERNAL, which the proto keeps for server bugs. Here an oversized
//! message is RESOURCE_EXHAUSTED and a malformed body INVALID_ARGUMENT, both
//! before tonic buffers a byte of the message, and every message is charged
//! to the server's in-flight bytes (`inflight.rs`) until the next one
//! arrives or its call ends.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use http_body::{Body as HttpBody, Frame};
use kvtier_sync::{Mutex, MutexGuard, Rank};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;

use crate::auth::{Auth, Caller};
use crate::inflight::{Held, InFlight};

/// The client-streaming methods: any number of messages is a valid
/// request (a handler that needs one refuses an empty stream itself).
const CLIENT_STREAMING: [&str; 2] = ["/kvtier.v1.KvTier/PutPages", "/kvtier.v1.KvTier/MoveSequence"];

/// The gRPC message header: a compression flag and a big-endian length.
const HEADER: usize = 5;

/// The in-flight bytes one call holds: its current message's, charged as
/// they arrive (a header alone claims nothing, so a client that announces
/// large messages and sends nothing holds nothing). Released when the next
/// message of the stream starts, and when the body, the call and whatever
/// keeps the request beyond it (a fetch streaming its chunks) are done: a
/// decoded message's bytes live as long as its request.
#[derive(Debug)]
struct Charge {
    in_flight: Arc<InFlight>,
    held: Mutex<Option<Held>>,
}

/// A request's in-flight bytes, for a handler that keeps the request past
/// its own return.
#[derive(Debug, Clone)]
pub(crate) struct RequestBytes {
    _charge: Arc<Charge>,
}

impl Charge {
    fn held(&self) -> MutexGuard<'_, Option<Held>> {
        self.held.lock()
    }

    /// A new message starts: the previous one's bytes are decoded by now.
    fn start(&self) {
        *self.held() = None;
    }

    /// `n` more bytes of the current message arrived.
    fn add(&self, n: usize) -> Result<(), Status> {
        let more = self.in_flight.try_hold(n)?;
        let mut held = self.held();
        match held.as_mut() {
            Some(h) => h.merge(more),
            None => *held = Some(more),
        }
        Ok(())
    }
}

#[derive(Debug)]
pub(crate) struct GateConfig {
    pub(crate) auth: Auth,
    pub(crate) max_message_bytes: usize,
    pub(crate) in_flight: Arc<InFlight>,
}

/// Wraps the `kvtier.v1` service.
#[derive(Debug, Clone)]
pub(crate) struct Gate<S> {
    inner: S,
    config: Arc<GateConfig>,
}

impl<S> Gate<S> {
    pub(crate) fn new(inner: S, config: Arc<GateConfig>) -> Self {
        Self { inner, config }
    }
}

impl<S: NamedService> NamedService for Gate<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Gate<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let caller = match self.config.auth.caller(request.headers()) {
            Ok(caller) => caller,
            Err(status) => return Box::pin(std::future::ready(Ok(status.into_http()))),
        };
        let (mut parts, body) = request.into_parts();
        parts.extensions.insert::<Caller>(caller);
        let charge = Arc::new(Charge {
            in_flight: Arc::clone(&self.config.in_flight),
            held: Mutex::new(Rank::Gate, None),
        });
        parts.extensions.insert(RequestBytes {
            _charge: Arc::clone(&charge),
        });
        let body = Checked {
            inner: body,
            limit: self.config.max_message_bytes,
            unary: !CLIENT_STREAMING.contains(&parts.uri.path()),
            header: [0; HEADER],
            have: 0,
            left: 0,
            messages: 0,
            charge: Arc::clone(&charge),
            failed: false,
        };
        let call = self.inner.call(http::Request::from_parts(parts, Body::new(body)));
        Box::pin(async move {
            let response = call.await;
            drop(charge);
            response
        })
    }
}

/// A request body whose gRPC framing is checked frame by frame.
#[derive(Debug)]
struct Checked {
    inner: Body,
    limit: usize,
    unary: bool,
    header: [u8; HEADER],
    /// Header bytes of the next message seen so far.
    have: usize,
    /// Bytes of the current message still to come.
    left: usize,
    messages: u64,
    charge: Arc<Charge>,
    failed: bool,
}

impl Checked {
    fn scan(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.left > 0 {
                let n = self.left.min(data.len());
                self.charge.add(n)?;
                self.left -= n;
                data.advance(n);
                continue;
            }
            let n = (HEADER - self.have).min(data.len());
            self.header[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data.advance(n);
            if self.have == HEADER {
                self.have = 0;
                self.begin_message()?;
            }
        }
        Ok(())
    }

    fn begin_message(&mut self) -> Result<(), Status> {
        let len = u32::from_be_bytes(self.header[1..].try_into().expect("four bytes")) as usize;
        match self.header[0] {
            0 => {}
            1 => {
                return Err(Status::invalid_argument(
                    "the request message is compressed; this server accepts only uncompressed messages",
                ));
            }
            flag => {
                return Err(Status::invalid_argument(format!(
                    "the request message's compression flag is {flag}; gRPC allows 0 or 1"
                )));
            }
        }
        if len > self.limit {
            return Err(Status::resource_exhausted(format!(
                "a request message of {len} bytes is larger than the server's limit of {} bytes \
                 (max_message_bytes); split the write",
                self.limit
            )));
        }
        self.messages += 1;
        if self.unary && self.messages > 1 {
            return Err(Status::invalid_argument(
                "a unary request carries more than one message",
            ));
        }
        self.charge.start();
        self.left = len;
        Ok(())
    }

    fn finish(&self) -> Result<(), Status> {
        if self.have > 0 || self.left > 0 {
            return Err(Status::invalid_argument("the request body ends inside a message"));
        }
        if self.unary && self.messages == 0 {
            return Err(Status::invalid_argument("the request carries no message"));
        }
        Ok(())
    }
}

impl HttpBody for Checked {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let next = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        let checked = match next {
            Some(Ok(frame)) => match frame.data_ref() {
                Some(data) => self.scan(data).map(|()| Some(frame)),
                None => Ok(Some(frame)),
            },
            Some(Err(e)) => Err(e),
            None => self.finish().map(|()| None),
        };
        match checked {
            Ok(frame) => Poll::Ready(frame.map(Ok)),
            Err(status) => {
                self.failed = true;
                Poll::Ready(Some(Err(status)))
            }
        }
    }
}
