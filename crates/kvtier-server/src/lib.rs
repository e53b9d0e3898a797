#![warn(missing_docs)]
//! The kvtier gRPC server: `kvtier.v1.KvTier`, `grpc.health.v1.Health`,
//! server reflection, and Prometheus metrics over HTTP.

mod auth;
mod blocking;
mod chunk;
mod conn;
mod convert;
mod gate;
mod inflight;
mod membership;
mod metrics;
mod metrics_listener;
mod moves;
mod responses;
mod rpc_metrics;
mod service;
mod shm;
mod status;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier_cluster::Node;
use kvtier_proto::v1::kv_tier_server::KvTierServer;
use kvtier_store::Store;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use auth::{Auth, Grant, Token};
pub use convert::mode_to_pb;
pub use membership::{CLUSTER_HEALTH_SERVICE, StoreSequences, capacity};
pub use moves::PeerConfig;

use crate::gate::{Gate, GateConfig};
use crate::inflight::InFlight;
use crate::rpc_metrics::{RpcMetrics, Timed};
use crate::service::KvTierService;
use crate::shm::Regions;

/// What [`BoundServer::bind`] listens on and the limits it serves under. The default serves
/// plaintext without tokens on loopback: gRPC on 127.0.0.1:50051, metrics on 127.0.0.1:9464.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The gRPC address (`kvtier.v1`, health, reflection); port 0 picks a free port (read it back
    /// with [`BoundServer::grpc_addr`]). Off loopback it needs tokens and TLS unless `insecure`.
    pub listen: SocketAddr,
    /// Prometheus `/metrics`; `None` disables it. Served over TLS where
    /// `tls` is set, and only to an admin token where `auth` has tokens.
    pub metrics_listen: Option<SocketAddr>,
    /// Largest message accepted or sent, in bytes.
    pub max_message_bytes: usize,
    /// Request and response messages held at once over all calls, in bytes:
    /// a request past it gets RESOURCE_EXHAUSTED, a response waits for room.
    pub max_inflight_bytes: usize,
    /// Open connections; more are closed as they arrive.
    pub max_connections: usize,
    /// Bearer tokens; none: every caller may act for every tenant.
    pub auth: Auth,
    /// PEM certificate chain and private key; `None`: plaintext.
    pub tls: Option<TlsFiles>,
    /// Serve on a non-loopback address without tokens or without TLS.
    pub insecure: bool,
    /// The Unix socket where local clients register shared-memory regions
    /// for the shm data plane; `None`: no shm data plane.
    pub shm_socket: Option<PathBuf>,
    /// How long a thread serving a region's connection polls for the next
    /// call at most before sleeping on it, while the connection's calls
    /// have been coming within that (zero: never polls), unless a call asks
    /// for another after it (`LocalCall.poll_next_us`).
    pub shm_poll: Duration,
    /// The longest poll a call may ask for; a longer ask counts as this
    /// (zero: calls cannot ask). Polls longer than `shm_poll` are given to
    /// as many connections at once as half the cores.
    pub shm_poll_max: Duration,
    /// Where recordings that `SetAccessTrace` starts go; `None`: the RPC
    /// cannot start one.
    pub access_trace_dir: Option<PathBuf>,
    /// A recording's size bound when the request gives none.
    pub access_trace_max_bytes: u64,
}

/// How long a region's connection thread polls for the next call at most
/// ([`ServerConfig::shm_poll`]). Waking a thread that sleeps between a
/// worker's back-to-back calls costs tens of microseconds on VMs, and
/// polling stops by itself where calls come further apart (but for one
/// wait in 16, which polls to see whether they would come within it
/// again).
pub const DEFAULT_SHM_POLL: Duration = Duration::from_micros(50);

/// The longest poll a region's call may ask its thread for
/// ([`ServerConfig::shm_poll_max`]): an engine's decode loop calls once per
/// layer, a layer's compute apart (SmolLM2 on 2 cores: about 3 ms).
pub const DEFAULT_SHM_POLL_MAX: Duration = Duration::from_millis(10);

/// How long a shutdown waits for scrapes in flight.
const METRICS_DRAIN: Duration = Duration::from_secs(2);

/// The server's TLS identity, read when [`BoundServer::serve`] starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificate chain.
    pub cert: PathBuf,
    /// PEM private key of the certificate.
    pub key: PathBuf,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: ([127, 0, 0, 1], 50051).into(),
            metrics_listen: Some(([127, 0, 0, 1], 9464).into()),
            max_message_bytes: 64 << 20,
            max_inflight_bytes: 1 << 30,
            max_connections: 256,
            auth: Auth::default(),
            tls: None,
            insecure: false,
            shm_socket: None,
            shm_poll: DEFAULT_SHM_POLL,
            shm_poll_max: DEFAULT_SHM_POLL_MAX,
            access_trace_dir: None,
            access_trace_max_bytes: 1 << 30,
        }
    }
}

impl ServerConfig {
    /// Refuses limits that cannot work, and to expose the store beyond this
    /// machine unprotected (as Redis's protected mode does): off loopback,
    /// the gRPC port and the metrics port need tokens and TLS, unless
    /// `insecure` says otherwise.
    fn check(&self) -> Result<(), ServerError> {
        if self.max_inflight_bytes / 2 < self.max_message_bytes || self.max_connections == 0 {
            return Err(ServerError::Config(format!(
                "max_inflight_bytes ({}) must hold two messages of max_message_bytes ({}): one request \
                 and one response; and max_connections ({}) must be at least 1",
                self.max_inflight_bytes, self.max_message_bytes, self.max_connections
            )));
        }
        if self.insecure {
            return Ok(());
        }
        let missing = match (self.auth.enabled(), self.tls.is_some()) {
            (true, true) => None,
            (false, true) => Some("no auth tokens are configured"),
            (true, false) => Some("TLS is not configured (tokens would cross the network in plaintext)"),
            (false, false) => Some("neither auth tokens nor TLS are configured"),
        };
        if let Some(missing) = missing.filter(|_| !self.listen.ip().is_loopback()) {
            return Err(ServerError::Exposed {
                addr: self.listen,
                why: missing.to_owned(),
            });
        }
        // The metrics port serves under the gRPC port's TLS and tokens
        // (an admin token), so it may leave loopback on the same terms.
        match (self.metrics_listen, missing) {
            (Some(addr), Some(missing)) if !addr.ip().is_loopback() => Err(ServerError::Exposed {
                addr,
                why: format!("{missing} (the metrics endpoint serves under the gRPC port's TLS and tokens)"),
            }),
            _ => Ok(()),
        }
    }
}

/// Why the server refused to start, or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A listen address off loopback lacks the protection it needs (see
    /// [`ServerConfig::insecure`]).
    #[error(
        "refusing to listen on {addr}, which is not loopback: {why}. Configure tokens ([[auth.tokens]]) \
         and TLS (--tls-cert, --tls-key), or pass --insecure to serve unprotected"
    )]
    Exposed {
        /// The address refused.
        addr: SocketAddr,
        /// What protection is missing.
        why: String,
    },
    /// Limits that cannot work: `max_inflight_bytes` below two messages of `max_message_bytes`,
    /// or no connections allowed.
    #[error("{0}")]
    Config(String),
    /// A TLS file could not be read.
    #[error("reading TLS {what} {path}: {source}")]
    TlsFile {
        /// `certificate` or `key`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The read error.
        source: std::io::Error,
    },
    /// The gRPC or metrics address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The bind error.
        source: std::io::Error,
    },
    /// The shared-memory Unix socket could not be bound.
    #[error("cannot listen on the shm socket {path}: {source}")]
    BindShm {
        /// The socket's path.
        path: PathBuf,
        /// The bind error.
        source: std::io::Error,
    },
    /// The gRPC transport failed, or refused the TLS identity.
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The metrics HTTP server failed. (Also reported when the gRPC socket's own address cannot
    /// be read for the start-up log.)
    #[error("metrics server failed: {0}")]
    Metrics(std::io::Error),
    /// The TLS identity does not parse for the metrics endpoint.
    #[error("metrics TLS: {0}")]
    MetricsTls(String),
    /// The reflection service could not be built from the file descriptor sets.
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// A server whose sockets are bound (so tests can ask for port 0 and read
/// the port back) but which is not serving yet.
#[derive(Debug)]
pub struct BoundServer {
    store: Arc<Store>,
    config: ServerConfig,
    grpc: TcpListener,
    metrics: Option<TcpListener>,
    shm: Option<tokio::net::UnixListener>,
    cluster: Option<(Arc<Node>, PeerConfig)>,
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, ServerError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })
}

impl BoundServer {
    /// Checks `config` and binds its sockets (gRPC, metrics, shm) without serving yet. Errors:
    /// [`ServerError::Config`] or [`ServerError::Exposed`] from the checks, [`ServerError::Bind`]
    /// or [`ServerError::BindShm`] from binding.
    pub async fn bind(store: Arc<Store>, config: ServerConfig) -> Result<Self, ServerError> {
        config.check()?;
        let grpc = bind(config.listen).await?;
        let metrics = match config.metrics_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let shm = match &config.shm_socket {
            Some(path) => Some(shm::bind(path).map_err(|source| ServerError::BindShm {
                path: path.clone(),
                source,
            })?),
            None => None,
        };
        Ok(Self {
            store,
            config,
            grpc,
            metrics,
            shm,
            cluster: None,
        })
    }

    /// Serves as a member of a cluster: sequence calls are checked against
    /// ownership, sequences move to other nodes (drains, rebalances) over
    /// `peers`, and a shutdown marks the node draining before it leaves.
    pub fn with_cluster(mut self, node: Arc<Node>, peers: PeerConfig) -> Self {
        self.cluster = Some((node, peers));
        self
    }

    /// The gRPC socket's bound address: the real port when `listen` asked for port 0.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc.local_addr().expect("bound socket has an address")
    }

    /// The metrics socket's bound address; `None` when metrics are off.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics
            .as_ref()
            .map(|m| m.local_addr().expect("bound socket has an address"))
    }

    /// Serves until `shutdown` completes, then drains in-flight calls.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), ServerError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let limit = self.config.max_message_bytes;
        let mover = self
            .cluster
            .clone()
            .map(|(node, peers)| Arc::new(moves::Mover::new(Arc::clone(&self.store), node, peers, limit)));
        let node = mover.as_ref().map(|m| Arc::clone(&m.node));
        let draining = node.clone();
        let drained = mover.as_ref().map(|m| m.drained());
        tokio::spawn(async move {
            // A drain that emptied the node stops it as a shutdown does.
            match drained {
                Some(drained) => tokio::select! {
                    () = shutdown => {}
                    () = drained => tracing::info!("drained: stopping"),
                },
                None => shutdown.await,
            }
            // Placement skips a draining node: no new sequence comes here
            // while the calls in flight finish.
            if let Some(node) = draining {
                node.start_draining().await;
            }
            let _ = stop_tx.send(true);
        });
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };

        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_serving::<KvTierServer<KvTierService>>().await;
        health
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        if let Some(node) = &node {
            let name = <KvTierServer<KvTierService> as tonic::server::NamedService>::NAME;
            tokio::spawn(membership::report_health(Arc::clone(node), health.clone(), name));
        }
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(kvtier_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let reflection_v1 = reflection().build_v1()?;
        let reflection_v1alpha = reflection().build_v1alpha()?;
        let in_flight = InFlight::new(self.config.max_inflight_bytes);
        let regions = Arc::new(Regions::default());
        let traces = service::TraceSettings {
            dir: self.config.access_trace_dir.clone(),
            max_bytes: self.config.access_trace_max_bytes,
        };
        let service = KvTierService::new(
            Arc::clone(&self.store),
            limit,
            Arc::clone(&in_flight),
            Arc::clone(&regions),
            traces,
            mover,
        );
        let rpc_metrics = Arc::new(RpcMetrics::default());
        let shm = if let (Some(listener), Some(path)) = (self.shm, &self.config.shm_socket) {
            let stop = stopped(stop_rx.clone());
            let ctx = shm::CallContext {
                calls: Arc::new(service.clone()),
                regions,
                in_flight: Arc::clone(&in_flight),
                metrics: Arc::clone(&rpc_metrics),
                max_frame: limit,
                poll: self.config.shm_poll,
                poll_max: self.config.shm_poll_max,
                long_polls: shm::LongPolls::for_cores(),
            };
            let auth = Arc::new(self.config.auth.clone());
            Some(tokio::spawn(shm::serve(listener, path.clone(), ctx, auth, stop)))
        } else {
            None
        };
        let kvtier = KvTierServer::new(service)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit);
        let kvtier = Gate::new(
            kvtier,
            Arc::new(GateConfig {
                auth: self.config.auth.clone(),
                max_message_bytes: limit,
                in_flight,
            }),
        );
        let kvtier = Timed::new(kvtier, Arc::clone(&rpc_metrics));
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = &self.config.tls {
            builder = builder.tls_config(tls_config(tls)?)?;
        }

        let metrics_tls = match &self.config.tls {
            Some(files) => {
                let (cert, key) = read_tls(files)?;
                Some(metrics_listener::tls_config(&cert, &key).map_err(ServerError::MetricsTls)?)
            }
            None => None,
        };
        let metrics = match self.metrics {
            Some(listener) => {
                let router = metrics::router(Arc::clone(&self.store), rpc_metrics, self.config.auth.clone());
                let listener =
                    metrics_listener::MetricsListener::new(listener, metrics_tls).map_err(ServerError::Metrics)?;
                let stop = stopped(stop_rx.clone());
                Some(tokio::spawn(async move {
                    axum::serve(listener, router).with_graceful_shutdown(stop).await
                }))
            }
            None => None,
        };
        let scheme = if self.config.tls.is_some() { "https" } else { "http" };
        tracing::info!(
            grpc = %self.grpc.local_addr().map_err(ServerError::Metrics)?,
            metrics = %self.config.metrics_listen.map_or("off".to_owned(), |a| format!("{scheme}://{a}/metrics")),
            tls = self.config.tls.is_some(),
            auth = self.config.auth.enabled(),
            shm_socket = %self.config.shm_socket.as_ref().map_or("off".to_owned(), |p| p.display().to_string()),
            shm_poll_us = self.config.shm_poll.as_micros() as u64,
            shm_poll_max_us = self.config.shm_poll_max.as_micros() as u64,
            "serving kvtier.v1"
        );
        // Larger HTTP/2 windows and frames: the defaults cap one client at
        // about half of what loopback carries for megabyte messages.
        // Keepalive pings find peers that vanished without closing, and
        // free their connection slots.
        builder
            .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)))
            .initial_stream_window_size(Some(16 << 20))
            .initial_connection_window_size(Some(32 << 20))
            .max_frame_size(Some((1 << 20) - 1))
            .tcp_nodelay(true)
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(kvtier)
            .serve_with_incoming_shutdown(conn::incoming(self.grpc, self.config.max_connections), stopped(stop_rx))
            .await?;
        if let Some(mut metrics) = metrics {
            // A scrape in flight gets a moment to finish; a client that
            // holds its connection open does not hold up the shutdown.
            match tokio::time::timeout(METRICS_DRAIN, &mut metrics).await {
                Ok(Ok(result)) => result.map_err(ServerError::Metrics)?,
                Ok(Err(e)) => tracing::warn!(error = %e, "metrics task ended abnormally"),
                Err(_) => {
                    tracing::info!("metrics: connections still open after {METRICS_DRAIN:?}; closed");
                    metrics.abort();
                }
            }
        }
        // Its connections' threads hold the store until they are ended.
        if let Some(shm) = shm
            && let Err(e) = shm.await
        {
            tracing::warn!(error = %e, "shm socket task ended abnormally");
        }
        if let Some(node) = &node {
            node.leave().await;
        }
        // A recording still running is finished: everything queued written.
        self.store.stop_access_trace();
        tracing::info!("kvtier.v1 stopped");
        Ok(())
    }
}

/// The certificate chain and key, as PEM.
fn read_tls(files: &TlsFiles) -> Result<(Vec<u8>, Vec<u8>), ServerError> {
    let read = |what, path: &PathBuf| {
        std::fs::read(path).map_err(|source| ServerError::TlsFile {
            what,
            path: path.clone(),
            source,
        })
    };
    Ok((read("certificate", &files.cert)?, read("key", &files.key)?))
}

fn tls_config(files: &TlsFiles) -> Result<tonic::transport::ServerTlsConfig, ServerError> {
    let (cert, key) = read_tls(files)?;
    Ok(tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(cert, key)))
}
