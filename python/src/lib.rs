//! `kvtier._native`: the Rust client (connection, TLS, token, the
//! shared-memory registration) under one reflection-driven `call`, which
//! the pure-Python package (`python/kvtier/`) wraps in typed methods and
//! numpy arrays. A call blocks with the GIL released, or, given a `done`
//! callback, runs on the package's runtime and reports through it (the
//! asyncio client).

mod codec;
mod reflect;

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::OnceLock;

use kvtier_client::{Client, Connect, MAX_MESSAGE_BYTES, ShmError, ShmRegion, Tls};
use prost_reflect::{DescriptorPool, DynamicMessage, MethodDescriptor, ServiceDescriptor};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;
use tonic::client::Grpc;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::{Code, Status};

use codec::DynamicCodec;

/// The runtime every connection of the process shares; never dropped, so
/// no Python object's destructor waits for its threads.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvtier-client")
            .enable_all()
            .build()
            .expect("the client's runtime starts") // only fails when no threads can be spawned
    })
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

/// A failed call as the package's exception for its status code
/// (`kvtier.errors`). A status the server sent has no source; one with a
/// source was made on this side from a broken connection or an HTTP/2
/// failure (tonic reports them as UNKNOWN, INTERNAL or CANCELLED, which of
/// them depending on timing): that is UNAVAILABLE, with the cause spelled
/// out.
fn status_error(py: Python<'_>, status: &Status) -> PyErr {
    let (code, message) = match std::error::Error::source(status) {
        Some(cause) => {
            let mut message = format!("the connection failed: {}: {cause}", status.message());
            let mut next = cause.source();
            while let Some(cause) = next {
                message.push_str(&format!(": {cause}"));
                next = cause.source();
            }
            (Code::Unavailable, message)
        }
        _ => (status.code(), status.message().to_owned()),
    };
    let built = py
        .import("kvtier.errors")
        .and_then(|m| m.call_method1("from_status", (code as i32, message)));
    match built {
        Ok(exception) => PyErr::from_value(exception),
        Err(e) => e,
    }
}

/// What a call returns: one message, or a server stream's messages.
enum Reply {
    One(DynamicMessage),
    Many(Vec<DynamicMessage>),
}

impl Reply {
    fn into_py(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(match self {
            Reply::One(m) => reflect::to_dict(py, &m)?.into_any().unbind(),
            Reply::Many(ms) => {
                let dicts = ms
                    .iter()
                    .map(|m| reflect::to_dict(py, m))
                    .collect::<PyResult<Vec<_>>>()?;
                PyList::new(py, dicts)?.into_any().unbind()
            }
        })
    }
}

/// A connection to one kvtier server.
#[pyclass(frozen, module = "kvtier._native")]
struct Connection {
    client: Client,
    token: Option<String>,
}

#[pymethods]
impl Connection {
    /// Connects to `address` (`http://host:port`, or `https://` with
    /// `ca_pem`); `token` goes with every call.
    #[new]
    #[pyo3(signature = (address, token=None, ca_pem=None, domain=None))]
    fn new(
        py: Python<'_>,
        address: String,
        token: Option<String>,
        ca_pem: Option<Vec<u8>>,
        domain: Option<String>,
    ) -> PyResult<Self> {
        let options = Connect {
            token: token.clone(),
            tls: ca_pem.map(|ca_pem| Tls { ca_pem, domain }),
        };
        let client = py
            .detach(|| runtime().block_on(Client::connect_with(address, options)))
            .map_err(|e| status_error(py, &Status::unavailable(e.to_string())))?;
        Ok(Self { client, token })
    }

    /// Calls `method` (`"FetchPages"`) with `request`: a dict, or for
    /// `PutPages` a list of dicts. Returns a dict, or a list of dicts for a
    /// server stream. With `done`, returns at once and calls
    /// `done(result, exception)` from a runtime thread when it finishes.
    #[pyo3(signature = (method, request, done=None))]
    fn call(
        &self,
        py: Python<'_>,
        method: &str,
        request: &Bound<'_, PyAny>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let method = service()?
            .methods()
            .find(|m| m.name() == method)
            .ok_or_else(|| PyValueError::new_err(format!("method: kvtier.v1.KvTier has no method {method:?}")))?;
        let requests = if method.is_client_streaming() {
            let items: Vec<Bound<'_, PyAny>> = request.try_iter()?.collect::<PyResult<_>>()?;
            items
                .iter()
                .enumerate()
                .map(|(i, r)| reflect::to_message(r, &method.input(), &format!("requests[{i}]")))
                .collect::<PyResult<Vec<_>>>()?
        } else {
            vec![reflect::to_message(request, &method.input(), "")?]
        };
        let reply = send(self.client.clone(), method, requests);
        match done {
            None => match py.detach(|| runtime().block_on(reply)) {
                Ok(reply) => reply.into_py(py),
                Err(status) => Err(status_error(py, &status)),
            },
            Some(done) => {
                runtime().spawn(async move {
                    let reply = reply.await;
                    Python::attach(|py| {
                        let result = reply
                            .map_err(|status| status_error(py, &status))
                            .and_then(|r| r.into_py(py));
                        let args = match result {
                            Ok(value) => (value, py.None()),
                            Err(e) => (py.None(), e.into_value(py).into_any()),
                        };
                        if let Err(e) = done.call1(py, args) {
                            e.write_unraisable(py, None);
                        }
                    });
                });
                Ok(py.None())
            }
        }
    }

    /// Registers a new shared-memory region of `size` bytes for `tenant`
    /// at the server's shm socket (it must run on this machine).
    fn register_shm(&self, py: Python<'_>, socket: PathBuf, size: usize, tenant: String) -> PyResult<Region> {
        let token = self.token.as_deref();
        let region = py
            .detach(|| runtime().block_on(ShmRegion::register(&socket, size, &tenant, token)))
            .map_err(|e| match e {
                ShmError::Refused(status) => status_error(py, &status),
                other => status_error(py, &Status::new(Code::Unavailable, other.to_string())),
            })?;
        Ok(Region(region))
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
/// lives (or until `close`).
#[pyclass(module = "kvtier._native")]
struct Region(ShmRegion);

#[pymethods]
impl Region {
    /// The id requests name in their `shm` window.
    #[getter]
    fn id(&self) -> u64 {
        self.0.id()
    }

    /// The region's size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.0.len()
    }

    /// The region's memfd, to map it (`mmap.mmap(fd, size)`); valid while
    /// this object lives.
    #[getter]
    fn fd(&self) -> i32 {
        self.0.fd().as_raw_fd()
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Connection>()?;
    m.add_class::<Region>()?;
    Ok(())
}
