//! `kvtier._native`: the Rust client (connection, TLS, token, the
//! shared-memory registration) under one reflection-driven `call`, which
//! the pure-Python package (`python/kvtier/`) wraps in typed methods and
//! numpy arrays; a decode step's selection is made once and sent every
//! step as the generated type (`select_request.rs`, `gathered.rs`). A call
//! blocks with the GIL released, or, given a `done`
//! callback, runs on the package's runtime and reports through it (the
//! asyncio client).

mod bytearray;
mod codec;
mod gathered;
mod partitioned;
mod reflect;
mod select_request;
mod select_totals;

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use kvtier_client::{Client, Connect, MAX_MESSAGE_BYTES, ShmError, ShmRegion, Tls};
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, MethodDescriptor, ServiceDescriptor, Value};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;
use tonic::client::Grpc;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::{Code, Status};

use codec::DynamicCodec;
use gathered::Gathered;
use kvtier_proto::v1 as pb;
use select_request::SelectRequest;

/// The runtime the connections of this process share, with the process it
/// belongs to: a child after `fork()` has none of its threads.
#[derive(Debug)]
struct Runtime {
    pid: u32,
    tokio: tokio::runtime::Runtime,
}

/// This process's runtime, made on first use (and again in a forked
/// child). A runtime is never dropped, so no Python object's destructor
/// waits for its threads; a forked child's copy of its parent's, whose
/// threads it does not have, is leaked.
fn runtime() -> PyResult<Arc<Runtime>> {
    static CURRENT: Mutex<Option<Arc<Runtime>>> = Mutex::new(None);
    let mut current = CURRENT.lock().unwrap_or_else(|p| p.into_inner());
    let pid = std::process::id();
    if let Some(rt) = current.as_ref().filter(|rt| rt.pid == pid) {
        return Ok(Arc::clone(rt));
    }
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvtier-client")
        .enable_all()
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("starting the client's threads: {e}")))?;
    let rt = Arc::new(Runtime { pid, tokio });
    if let Some(parents) = current.replace(Arc::clone(&rt)) {
        std::mem::forget(parents);
    }
    Ok(rt)
}

/// Runs `future` on `rt` with the GIL released, waking every 100 ms to let
/// Python raise a pending signal (Ctrl-C), which drops the call.
fn wait<F>(py: Python<'_>, rt: &Runtime, future: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let mut future = Box::pin(future);
    loop {
        // The timer is made inside the runtime, which it needs.
        let tick = py.detach(|| {
            rt.tokio
                .block_on(async { tokio::time::timeout(Duration::from_millis(100), &mut future).await })
        });
        match tick {
            Ok(output) => return Ok(output),
            Err(_) => py.check_signals()?,
        }
    }
}

fn service() -> PyResult<&'static ServiceDescriptor> {
    static SERVICE: OnceLock<Result<ServiceDescriptor, String>> = OnceLock::new();
    SERVICE
        .get_or_init(|| {
            let pool = DescriptorPool::decode(kvtier_proto::FILE_DESCRIPTOR_SET).map_err(|e| e.to_string())?;
            pool.get_service_by_name("kvtier.v1.KvTier")
                .ok_or_else(|| "kvtier.v1.KvTier is not in the descriptor".to_owned())
        })
        .as_ref()
        .map_err(|e| PyRuntimeError::new_err(e.clone()))
}

/// The service's method `name`.
fn method(name: &str) -> PyResult<MethodDescriptor> {
    service()?
        .methods()
        .find(|m| m.name() == name)
        .ok_or_else(|| PyValueError::new_err(format!("method: kvtier.v1.KvTier has no method {name:?}")))
}

/// `request` as a message of `method`'s input: a dict, or for SelectPages
/// a [`SelectRequest`]; errors name the field (`path`).
fn request_message(request: &Bound<'_, PyAny>, method: &MethodDescriptor, path: &str) -> PyResult<DynamicMessage> {
    match request.cast::<SelectRequest>() {
        Ok(typed) if method.name() == "SelectPages" => typed.get().dynamic(),
        _ => reflect::to_message(request, &method.input(), path),
    }
}

/// A failed call as the package's exception for its status code
/// (`kvtier.errors`); a status made on this side (a broken connection:
/// UNAVAILABLE) as the Rust client reads it (`kvtier_client::call_status`).
fn status_error(py: Python<'_>, status: &Status) -> PyErr {
    let (code, message) =
        kvtier_client::call_status(status).unwrap_or_else(|| (status.code(), status.message().to_owned()));
    // A cluster node's refusal names the sequence's owner in metadata.
    let owner = kvtier_client::refusal_owner(status);
    let built = py
        .import("kvtier.errors")
        .and_then(|m| m.call_method1("from_status", (code as i32, message, owner)));
    match built {
        Ok(exception) => PyErr::from_value(exception),
        Err(e) => e,
    }
}

/// What a call returns: one message, a server stream's messages, or a
/// selection gathered per head (boxed, as it holds a whole first message).
enum Reply {
    One(DynamicMessage),
    Many(Vec<DynamicMessage>),
    Gathered(Box<Gathered>),
}

impl Reply {
    /// The reply as Python values; a gathered selection's pages in
    /// `region` read from it (held by the caller).
    /// With `views`, a gathered selection's heads laid out in `region` in
    /// one run each are given as where they are (`Gathered::into_py`).
    fn into_py(self, py: Python<'_>, region: Option<&ShmRegion>, views: bool) -> PyResult<Py<PyAny>> {
        Ok(match self {
            Reply::One(m) => reflect::to_dict(py, &m)?.into_any().unbind(),
            Reply::Many(ms) => {
                let dicts = ms
                    .iter()
                    .map(|m| reflect::to_dict(py, m))
                    .collect::<PyResult<Vec<_>>>()?;
                PyList::new(py, dicts)?.into_any().unbind()
            }
            Reply::Gathered(gathered) => gathered.into_py(py, region, views)?,
        })
    }
}

/// A connection to one kvtier server.
#[pyclass(frozen, module = "kvtier._native")]
struct Connection {
    client: Client,
    token: Option<String>,
    /// Every call's limit (`None`: none).
    timeout: Option<Duration>,
    runtime: Arc<Runtime>,
}

impl Connection {
    /// This connection's runtime, unless the process forked since it was made.
    fn runtime(&self) -> PyResult<&Runtime> {
        if self.runtime.pid != std::process::id() {
            return Err(PyRuntimeError::new_err(
                "this client was made before fork(); make a new one in the child process",
            ));
        }
        Ok(&self.runtime)
    }
}

#[pymethods]
impl Connection {
    /// Connects to `address` (`http://host:port`, or `https://` with
    /// `ca_pem`); `token` goes with every call; `timeout` (seconds) bounds
    /// connecting and every call.
    #[new]
    #[pyo3(signature = (address, token=None, ca_pem=None, domain=None, timeout=None))]
    fn new(
        py: Python<'_>,
        address: String,
        token: Option<String>,
        ca_pem: Option<Vec<u8>>,
        domain: Option<String>,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let timeout = timeout
            .map(|t| {
                Duration::try_from_secs_f64(t)
                    .map_err(|_| PyValueError::new_err("timeout: a number of seconds above 0"))
            })
            .transpose()?;
        let options = Connect {
            token: token.clone(),
            tls: ca_pem.map(|ca_pem| Tls { ca_pem, domain }),
        };
        let runtime = runtime()?;
        let connecting = limited(timeout, async {
            Client::connect_with(address, options)
                .await
                .map_err(|e| Status::unavailable(e.to_string()))
        });
        let client = wait(py, &runtime, connecting)?.map_err(|status| status_error(py, &status))?;
        Ok(Self {
            client,
            token,
            timeout,
            runtime,
        })
    }

    /// Calls `method` (`"FetchPages"`) with `request`: a dict, or for
    /// `PutPages` a list of dicts. Returns a dict, or a list of dicts for a
    /// server stream. With `done`, returns a `Pending` at once and calls
    /// `done(result, exception)` from a runtime thread when it finishes.
    /// With `incarnation` (a cluster's), the call is meant for that
    /// creation of its sequence: a node refuses it for a later one.
    /// With `gather` (SelectPages only), returns the selection gathered per
    /// head (`gathered.rs`) instead of dicts.
    #[pyo3(signature = (method, request, done=None, incarnation=None, gather=false))]
    fn call(
        &self,
        py: Python<'_>,
        method: &str,
        request: &Bound<'_, PyAny>,
        done: Option<Py<PyAny>>,
        incarnation: Option<u64>,
        gather: bool,
    ) -> PyResult<Py<PyAny>> {
        let rt = self.runtime()?;
        let method = self::method(method)?;
        let requests = if method.is_client_streaming() {
            let items: Vec<Bound<'_, PyAny>> = request.try_iter()?.collect::<PyResult<_>>()?;
            items
                .iter()
                .enumerate()
                .map(|(i, r)| request_message(r, &method, &format!("requests[{i}]")))
                .collect::<PyResult<Vec<_>>>()?
        } else {
            vec![request_message(request, &method, "")?]
        };
        if gather {
            gatherable(&method)?;
        }
        let client = self.client.clone().with_incarnation(incarnation.unwrap_or(0));
        let reply = limited(self.timeout, async move {
            let reply = send(client, method, requests).await?;
            match (gather, reply) {
                (false, reply) => Ok(reply),
                (true, Reply::Many(messages)) => {
                    let typed = messages
                        .iter()
                        .map(DynamicMessage::transcode_to::<pb::SelectPagesResponse>)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| Status::internal(format!("the server's reply: {e}")))?;
                    Ok(Reply::Gathered(Box::new(Gathered::new(typed)?)))
                }
                (true, _) => Err(Status::internal("SelectPages answered with one message, not a stream")),
            }
        });
        match done {
            None => match wait(py, rt, reply)? {
                Ok(reply) => reply.into_py(py, None, false),
                Err(status) => Err(status_error(py, &status)),
            },
            Some(done) => {
                let task = rt.tokio.spawn(async move {
                    let reply = reply.await;
                    Python::attach(|py| {
                        let result = reply
                            .map_err(|status| status_error(py, &status))
                            .and_then(|r| r.into_py(py, None, false));
                        let args = match result {
                            Ok(value) => (value, py.None()),
                            Err(e) => (py.None(), e.into_value(py).into_any()),
                        };
                        if let Err(e) = done.call1(py, args) {
                            e.write_unraisable(py, None);
                        }
                    });
                });
                Ok(Pending(task.abort_handle()).into_pyobject(py)?.into_any().unbind())
            }
        }
    }

    /// Registers a new shared-memory region of `size` bytes for `tenant`
    /// at the server's shm socket (it must run on this machine).
    fn register_shm(&self, py: Python<'_>, socket: PathBuf, size: usize, tenant: String) -> PyResult<Region> {
        let rt = self.runtime()?;
        let token = self.token.as_deref();
        let registering = limited(self.timeout, async {
            ShmRegion::register(&socket, size, &tenant, token)
                .await
                .map_err(|e| match e {
                    ShmError::Refused(status) => status,
                    other => Status::unavailable(other.to_string()),
                })
        });
        let region = wait(py, rt, registering)?.map_err(|status| status_error(py, &status))?;
        Ok(Region {
            region: tokio::sync::Mutex::new(region),
            runtime: Arc::clone(&self.runtime),
            timeout: self.timeout,
        })
    }
}

/// An asynchronous call in flight.
#[pyclass(frozen, module = "kvtier._native")]
struct Pending(tokio::task::AbortHandle);

#[pymethods]
impl Pending {
    /// Stops waiting for the call and drops it (a request already sent may
    /// still take effect on the server).
    fn cancel(&self) {
        self.0.abort();
    }
}

/// Refuses `gather` for any method but SelectPages, whose answer alone is
/// gathered per head.
fn gatherable(method: &MethodDescriptor) -> PyResult<()> {
    if method.name() != "SelectPages" {
        return Err(PyValueError::new_err(format!(
            "gather: only SelectPages' answer is gathered per head, not {}'s",
            method.name()
        )));
    }
    Ok(())
}

/// `call`, failing with DEADLINE_EXCEEDED after `timeout`.
async fn limited<T>(timeout: Option<Duration>, call: impl Future<Output = Result<T, Status>>) -> Result<T, Status> {
    match timeout {
        None => call.await,
        Some(t) => tokio::time::timeout(t, call).await.unwrap_or_else(|_| {
            Err(Status::deadline_exceeded(format!(
                "no answer within the client's timeout of {} s",
                t.as_secs_f64()
            )))
        }),
    }
}

/// Sends `requests` (one, unless the method streams them) and collects the
/// reply.
async fn send(client: Client, method: MethodDescriptor, requests: Vec<DynamicMessage>) -> Result<Reply, Status> {
    let path = PathAndQuery::from_str(&format!("/{}/{}", method.parent_service().full_name(), method.name()))
        .map_err(|e| Status::internal(e.to_string()))?;
    let codec = DynamicCodec::new(method.output());
    let mut grpc = Grpc::new(client.channel())
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("the connection is not ready: {e}")))?;
    match (method.is_client_streaming(), method.is_server_streaming()) {
        (true, _) => {
            let request = client.request(tokio_stream::iter(requests));
            Ok(Reply::One(
                grpc.client_streaming(request, path, codec).await?.into_inner(),
            ))
        }
        (false, server_streams) => {
            let Some(message) = requests.into_iter().next() else {
                return Err(Status::invalid_argument("request: missing"));
            };
            let request = client.request(message);
            if server_streams {
                let mut stream = grpc.server_streaming(request, path, codec).await?.into_inner();
                let mut messages = Vec::new();
                while let Some(message) = stream.message().await? {
                    messages.push(message);
                }
                Ok(Reply::Many(messages))
            } else {
                Ok(Reply::One(grpc.unary(request, path, codec).await?.into_inner()))
            }
        }
    }
}

/// A registered shared-memory region; registered as long as this object
/// lives (or until `close`). Its connection to the server also carries
/// calls (`call`), one at a time.
#[pyclass(frozen, module = "kvtier._native")]
struct Region {
    region: tokio::sync::Mutex<ShmRegion>,
    runtime: Arc<Runtime>,
    /// The connection's limit on every call.
    timeout: Option<Duration>,
}

impl Region {
    /// The region, for a getter: its id, size and descriptor never change,
    /// so waiting for a call in flight to finish first is no loss.
    fn held(&self) -> tokio::sync::MutexGuard<'_, ShmRegion> {
        self.region.blocking_lock()
    }
}

#[pymethods]
impl Region {
    /// The id requests name in their `shm` window.
    #[getter]
    fn id(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.held().id())
    }

    /// The region's size in bytes.
    #[getter]
    fn size(&self, py: Python<'_>) -> usize {
        py.detach(|| self.held().len())
    }

    /// The region's memfd, to map it (`mmap.mmap(fd, size)`); valid while
    /// this object lives.
    #[getter]
    fn fd(&self, py: Python<'_>) -> i32 {
        py.detach(|| self.held().fd().as_raw_fd())
    }

    /// Seconds each call polls for its reply at most before sleeping on it,
    /// while the region's replies come within that
    /// (`kvtier_client::DEFAULT_SPIN`, 100 µs, until set; 0: never polls).
    #[getter]
    fn spin(&self, py: Python<'_>) -> f64 {
        py.detach(|| self.held().spin().as_secs_f64())
    }

    #[setter]
    fn set_spin(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let spin = seconds_from(seconds, "spin")?;
        py.detach(|| self.held().set_spin(spin));
        Ok(())
    }

    /// Seconds the server's thread for this region polls for its next call
    /// at most, as every call asks (`kvtier_client::ShmRegion::set_server_poll`;
    /// 0, until set: the server's own poll).
    #[getter]
    fn server_poll(&self, py: Python<'_>) -> f64 {
        py.detach(|| self.held().server_poll().as_secs_f64())
    }

    #[setter]
    fn set_server_poll(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let poll = seconds_from(seconds, "server_poll")?;
        py.detach(|| self.held().set_server_poll(poll));
        Ok(())
    }

    /// Calls `method` (`"FetchPages"`, `"SelectPages"` or `"AppendTokens"`)
    /// with `request` (a dict) over the region's own connection instead of
    /// gRPC (`kvtier.v1.LocalCall`): a list of dicts for FetchPages and
    /// SelectPages, as `Connection.call` returns, a dict for AppendTokens.
    /// Blocks with the GIL released; calls on one region run one at a time.
    /// With `gather` (SelectPages only), returns the selection gathered per
    /// head, as `Connection.call` does; with `views` too, heads the server
    /// laid out in one run each (`gather_heads`) as `(offset, length)` of
    /// their K rows and of their V rows in the region, not copied.
    #[pyo3(signature = (method, request, gather=false, views=false))]
    fn call(
        &self,
        py: Python<'_>,
        method: &str,
        request: &Bound<'_, PyAny>,
        gather: bool,
        views: bool,
    ) -> PyResult<Py<PyAny>> {
        if self.runtime.pid != std::process::id() {
            return Err(PyRuntimeError::new_err(
                "this region was registered before fork(); register a new one in the child process",
            ));
        }
        let descriptor = self::method(method)?;
        // The LocalCall field that carries the request.
        let field = match method {
            "FetchPages" => "fetch_pages",
            "SelectPages" => "select_pages",
            "AppendTokens" => "append_tokens",
            other => {
                return Err(PyValueError::new_err(format!(
                    "method: {other} does not go over a region's socket; FetchPages, SelectPages and AppendTokens do"
                )));
            }
        };
        let call = match request.cast::<SelectRequest>() {
            // A decode step's selection: encoded as the generated type.
            Ok(typed) if method == "SelectPages" => pb::LocalCall {
                call: Some(pb::local_call::Call::SelectPages(typed.get().request.clone())),
                poll_next_us: 0,
            }
            .encode_to_vec(),
            _ => {
                let local_call = descriptor
                    .parent_pool()
                    .get_message_by_name("kvtier.v1.LocalCall")
                    .ok_or_else(|| PyRuntimeError::new_err("kvtier.v1.LocalCall is not in the descriptor"))?;
                let mut call = DynamicMessage::new(local_call);
                call.set_field_by_name(
                    field,
                    Value::Message(reflect::to_message(request, &descriptor.input(), "")?),
                );
                call.encode_to_vec()
            }
        };
        if gather {
            gatherable(&descriptor)?;
        }
        // The time limit starts once the region is this call's (calls on
        // one region queue for it). A call it cuts short may still take
        // effect, as over gRPC; the region stays usable.
        let reply = async {
            let mut region = self.region.lock().await;
            let answer = limited(self.timeout, async {
                let raw = region
                    .call_raw(&call)
                    .await
                    .map_err(|e| Status::unavailable(format!("the region's connection failed: {e}")))?;
                let reply =
                    pb::LocalReply::decode(raw).map_err(|e| Status::internal(format!("the server's reply: {e}")))?;
                local_answer(reply, &descriptor, gather)
            })
            .await;
            (region, answer)
        };
        let (region, answer) = wait(py, &self.runtime, reply)?;
        // Its pages are read while the region is still this call's: the
        // next call on it may overwrite them.
        answer
            .map_err(|status| status_error(py, &status))?
            .into_py(py, Some(&region), views)
    }
}

/// `seconds` for the setter of `field`: from 0 up, finite.
fn seconds_from(seconds: f64, field: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| PyValueError::new_err(format!("{field}: is {seconds}, give seconds from 0 up")))
}

/// The answer to `method` in a region's `reply`: its refusal, the
/// selection to gather per head (with `gather`), or its messages as the
/// method's reply type.
fn local_answer(reply: pb::LocalReply, method: &MethodDescriptor, gather: bool) -> Result<Reply, Status> {
    if let Some(e) = reply.error {
        return Err(Status::new(Code::from_i32(e.code), e.message));
    }
    let output = method.output();
    match method.name() {
        "SelectPages" if gather => Ok(Reply::Gathered(Box::new(Gathered::new(reply.select_pages)?))),
        "SelectPages" => all_dynamic(&reply.select_pages, &output),
        "FetchPages" => all_dynamic(&reply.fetch_pages, &output),
        _ => match &reply.append_tokens {
            Some(m) => Ok(Reply::One(as_dynamic(m, &output)?)),
            None => Err(Status::internal(format!(
                "the server's reply holds no {} answer",
                method.name()
            ))),
        },
    }
}

/// `message` as a message of type `output` (its own), for `reflect::to_dict`.
fn as_dynamic<M: Message>(message: &M, output: &MessageDescriptor) -> Result<DynamicMessage, Status> {
    DynamicMessage::decode(output.clone(), message.encode_to_vec().as_slice())
        .map_err(|e| Status::internal(format!("the server's reply: {e}")))
}

/// A stream's `messages` as messages of type `output` (their own).
fn all_dynamic<M: Message>(messages: &[M], output: &MessageDescriptor) -> Result<Reply, Status> {
    Ok(Reply::Many(
        messages
            .iter()
            .map(|m| as_dynamic(m, output))
            .collect::<Result<_, _>>()?,
    ))
}

/// The serving nodes from a key's owner down, as indices into `nodes`
/// (`(node_id, weight)` pairs): kvtier's placement rule, the one nodes
/// apply (`kvtier_core::placement`). The key is the tenant and the first
/// prefix hash when there is one, else the tenant and the sequence id.
#[pyfunction]
#[pyo3(signature = (nodes, tenant, sequence_id, first_hash=None))]
fn placement(nodes: Vec<(String, f64)>, tenant: &str, sequence_id: &str, first_hash: Option<Vec<u8>>) -> Vec<usize> {
    use kvtier_core::placement::{Candidate, PlacementKey, ranking};
    let tenant = if tenant.is_empty() {
        kvtier_core::TenantId::DEFAULT
    } else {
        tenant
    };
    let key = match &first_hash {
        Some(first_hash) => PlacementKey::Prefix { tenant, first_hash },
        None => PlacementKey::Sequence { tenant, sequence_id },
    };
    let candidates: Vec<Candidate<'_>> = nodes
        .iter()
        .map(|(node_id, weight)| Candidate {
            node_id,
            weight: *weight,
        })
        .collect();
    ranking(key.hash(), &candidates)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(placement, m)?)?;
    m.add_function(wrap_pyfunction!(partitioned::select_partitioned, m)?)?;
    m.add_class::<Connection>()?;
    m.add_class::<Region>()?;
    m.add_class::<SelectRequest>()?;
    m.add_class::<select_totals::SelectTotals>()?;
    m.add_class::<Pending>()?;
    Ok(())
}
