//! Latency of every `kvtier.v1` call by transport, method and status code,
//! from the moment the request arrives to the end of its response (the last
//! message of a stream, with its trailers; over the shm socket, the reply's
//! frame), for the metrics endpoint.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use kvtier_proto::v1::METHODS;
use kvtier_store::Histogram;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;

/// gRPC status codes 0 (OK) to 16 (UNAUTHENTICATED).
const CODES: usize = 17;

/// How a call reached the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    Grpc,
    /// A `LocalCall` over a registered shm connection.
    ShmSocket,
}

impl Transport {
    const ALL: [Transport; 2] = [Transport::Grpc, Transport::ShmSocket];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Transport::Grpc => "grpc",
            Transport::ShmSocket => "shm-socket",
        }
    }
}

/// Histograms per (transport, method, code); a path that names no method
/// counts under the extra last row.
#[derive(Debug, Default)]
pub(crate) struct RpcMetrics {
    calls: [[[Histogram; CODES]; METHODS.len() + 1]; Transport::ALL.len()],
}

impl RpcMetrics {
    fn method(path: &str) -> usize {
        path.rsplit('/')
            .next()
            .and_then(|name| METHODS.iter().position(|m| *m == name))
            .unwrap_or(METHODS.len())
    }

    fn record(&self, transport: Transport, method: usize, code: usize, start: Instant) {
        let code = if code < CODES {
            code
        } else {
            tonic::Code::Unknown as usize
        };
        self.calls[transport as usize][method][code].observe(start.elapsed());
    }

    /// Records a call to the method named `name`.
    pub(crate) fn record_named(&self, transport: Transport, name: &str, code: tonic::Code, start: Instant) {
        let method = METHODS.iter().position(|m| *m == name).unwrap_or(METHODS.len());
        self.record(transport, method, code as usize, start);
    }

    /// Every (transport, method, code, histogram) that has seen a call.
    pub(crate) fn observed(&self) -> impl Iterator<Item = (Transport, &'static str, tonic::Code, &Histogram)> {
        Transport::ALL
            .into_iter()
            .zip(&self.calls)
            .flat_map(|(transport, methods)| {
                methods.iter().enumerate().flat_map(move |(m, codes)| {
                    let method = METHODS.get(m).copied().unwrap_or("unknown");
                    codes
                        .iter()
                        .enumerate()
                        .filter(|(_, h)| h.snapshot().count > 0)
                        .map(move |(c, h)| (transport, method, tonic::Code::from(c as i32), h))
                })
            })
    }
}

/// The grpc-status of a header or trailer map, if it has one.
fn status_code(headers: &http::HeaderMap) -> Option<usize> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

/// Wraps the `kvtier.v1` service (outside the gate, so refused calls count).
#[derive(Debug, Clone)]
pub(crate) struct Timed<S> {
    inner: S,
    metrics: Arc<RpcMetrics>,
}

impl<S> Timed<S> {
    pub(crate) fn new(inner: S, metrics: Arc<RpcMetrics>) -> Self {
        Self { inner, metrics }
    }
}

impl<S: NamedService> NamedService for Timed<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Timed<S>
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
        let start = Instant::now();
        let method = RpcMetrics::method(request.uri().path());
        let metrics = Arc::clone(&self.metrics);
        let call = self.inner.call(request);
        Box::pin(async move {
            // Until the response exists, the call is this future: dropped
            // (the client cancelled, its deadline passed), it is CANCELLED.
            let mut pending = TimedBody {
                inner: Body::empty(),
                metrics,
                method,
                start,
                done: false,
            };
            let response = call.await?;
            // A call that failed before any message answers with its status
            // in the headers (a trailers-only response).
            if let Some(code) = status_code(response.headers()) {
                pending.finish(code);
                return Ok(response);
            }
            let (parts, body) = response.into_parts();
            pending.inner = body;
            Ok(http::Response::from_parts(parts, Body::new(pending)))
        })
    }
}

/// A call being timed: recorded when its response's trailers pass, or, if
/// it is dropped before them (the client went away, its deadline passed,
/// before or during the response), as CANCELLED.
struct TimedBody {
    inner: Body,
    metrics: Arc<RpcMetrics>,
    method: usize,
    start: Instant,
    done: bool,
}

impl TimedBody {
    fn finish(&mut self, code: usize) {
        if !self.done {
            self.done = true;
            self.metrics.record(Transport::Grpc, self.method, code, self.start);
        }
    }
}

impl HttpBody for TimedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            Some(Ok(f)) => {
                if let Some(trailers) = f.trailers_ref() {
                    self.finish(status_code(trailers).unwrap_or(tonic::Code::Unknown as usize));
                }
            }
            Some(Err(_)) => self.finish(tonic::Code::Internal as usize),
            None => self.finish(tonic::Code::Unknown as usize),
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TimedBody {
    fn drop(&mut self) {
        self.finish(tonic::Code::Cancelled as usize);
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    #[test]
    fn the_methods_are_the_services_in_order() {
        let set = prost_types::FileDescriptorSet::decode(kvtier_proto::FILE_DESCRIPTOR_SET).unwrap();
        let service = set
            .file
            .iter()
            .flat_map(|f| &f.service)
            .find(|s| s.name() == "KvTier")
            .unwrap();
        let names: Vec<&str> = service.method.iter().map(|m| m.name()).collect();
        assert_eq!(names, METHODS);
    }

    #[test]
    fn paths_map_to_their_method_and_anything_else_to_the_last_row() {
        assert_eq!(RpcMetrics::method("/kvtier.v1.KvTier/FetchPages"), 5);
        assert_eq!(RpcMetrics::method("/kvtier.v1.KvTier/Nope"), METHODS.len());
    }
}
