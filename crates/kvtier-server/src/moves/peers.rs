//! Calls from this node to other nodes (a move's stream): one lazily
//! connected channel per peer address, over TLS where the address is
//! `https://` (verified against the configured authority), with the
//! configured admin token, since a move is an admin call at its receiver.

use std::collections::HashMap;
use std::time::Duration;

use kvtier_proto::v1::kv_tier_client::KvTierClient;
use kvtier_sync::{Mutex, Rank};
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// How this node reaches other nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerConfig {
    /// The bearer token presented to other nodes: an admin token there
    /// (nodes of a cluster share their tokens). `None`: no token.
    pub token: Option<String>,
    /// PEM authority that other nodes' certificates are checked against,
    /// for `https://` addresses (required for them).
    pub ca_pem: Option<Vec<u8>>,
}

/// Adds the peer token to every call.
#[derive(Debug, Clone)]
pub(crate) struct PeerToken(Option<MetadataValue<tonic::metadata::Ascii>>);

impl Interceptor for PeerToken {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert("authorization", token.clone());
        }
        Ok(request)
    }
}

/// A client of another node.
pub(crate) type PeerClient = KvTierClient<InterceptedService<Channel, PeerToken>>;

/// Channels to other nodes, by address.
#[derive(Debug)]
pub(crate) struct Peers {
    config: PeerConfig,
    max_message_bytes: usize,
    channels: Mutex<HashMap<String, Channel>>,
}

impl Peers {
    pub(crate) fn new(config: PeerConfig, max_message_bytes: usize) -> Self {
        Self {
            config,
            max_message_bytes,
            channels: Mutex::new(Rank::Peers, HashMap::new()),
        }
    }

    /// A client of the node at `addr`.
    pub(crate) fn client(&self, addr: &str) -> Result<PeerClient, String> {
        let channel = {
            let mut channels = self.channels.lock();
            match channels.get(addr) {
                Some(c) => c.clone(),
                None => {
                    let c = self.connect(addr)?;
                    channels.insert(addr.to_owned(), c.clone());
                    c
                }
            }
        };
        let token = match &self.config.token {
            Some(t) => Some(
                format!("Bearer {t}")
                    .parse()
                    .map_err(|_| "the peer token is not a valid header value".to_owned())?,
            ),
            None => None,
        };
        Ok(KvTierClient::with_interceptor(channel, PeerToken(token))
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes))
    }

    fn connect(&self, addr: &str) -> Result<Channel, String> {
        let mut endpoint = Endpoint::from_shared(addr.to_owned())
            .map_err(|e| format!("node address {addr:?}: {e}"))?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .initial_stream_window_size(Some(16 << 20))
            .initial_connection_window_size(Some(32 << 20));
        if addr.starts_with("https://") {
            let Some(ca) = &self.config.ca_pem else {
                return Err(format!(
                    "{addr} serves TLS, and this node has no authority to check its certificate against \
                     ([cluster] peer_ca, or [tls] ca)"
                ));
            };
            let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
            endpoint = endpoint.tls_config(tls).map_err(|e| format!("TLS for {addr}: {e}"))?;
        }
        Ok(endpoint.connect_lazy())
    }
}
