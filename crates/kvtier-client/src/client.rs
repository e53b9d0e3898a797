//! Typed calls over a tonic channel.

use kvtier_core::placement::INCARNATION;
use std::ops::Range;

use bytes::Bytes;
use tokio_stream::StreamExt;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::pb;
use crate::pb::kv_tier_client::KvTierClient;
use crate::pb::set_page_state_request::Action;
use crate::shm::{ShmError, ShmRegion};

/// What a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address does not parse, the TLS settings are unusable, or the
    /// connection could not be made.
    #[error("connecting: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// A refused call: the server's status (the proto lists each RPC's
    /// codes), or one the client made for an answer it cannot use; a
    /// connection that broke during the call is UNAVAILABLE (see
    /// [`call_status`]).
    #[error("{}: {}", .0.code(), .0.message())]
    Status(tonic::Status),
    /// K or V did not pack into the wire layout.
    #[error(transparent)]
    Pack(#[from] crate::PackError),
    /// The token cannot be sent in a header: it must be printable ASCII.
    #[error("token: {0}")]
    Token(String),
    /// A shared-memory region could not be registered, or its connection
    /// broke during a call.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// A cluster could not route the call (no node serving, etcd out of
    /// reach).
    #[error("cluster: {0}")]
    Cluster(String),
}

pub(crate) type Result<T> = std::result::Result<T, ClientError>;

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        match call_status(&status) {
            Some((code, message)) => ClientError::Status(tonic::Status::new(code, message)),
            None => ClientError::Status(status),
        }
    }
}

/// What a status made on this side means. A server's status has no source;
/// one tonic made from a failure here carries it: a status inside the chain
/// (a message over the size limit, say) is the real one, and anything else
/// is a broken connection or an HTTP/2 failure, which tonic reports as
/// UNKNOWN, INTERNAL or CANCELLED depending on timing: UNAVAILABLE, the
/// cause spelled out (the node is worth asking again, or another). `None`:
/// the status stands as it is.
pub fn call_status(status: &tonic::Status) -> Option<(tonic::Code, String)> {
    let first = std::error::Error::source(status)?;
    let chain = || std::iter::successors(Some(first), |cause| cause.source());
    // The innermost status is the one closest to what failed.
    Some(
        match chain().filter_map(|cause| cause.downcast_ref::<tonic::Status>()).last() {
            Some(inner) => (inner.code(), inner.message().to_owned()),
            None => {
                let causes: String = chain().map(|cause| format!(": {cause}")).collect();
                (
                    tonic::Code::Unavailable,
                    format!("the connection failed: {}{causes}", status.message()),
                )
            }
        },
    )
}

/// The node a cluster node's refusal names as the sequence's owner, with
/// its address (`kvtier-owner-node` / `kvtier-owner-addr` metadata).
pub fn refusal_owner(status: &tonic::Status) -> Option<(String, String)> {
    let get = |key| {
        status
            .metadata()
            .get(key)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    get(kvtier_core::placement::OWNER_NODE).zip(get(kvtier_core::placement::OWNER_ADDR))
}

/// Largest message the client sends or accepts.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// A layout message.
pub fn layout(
    num_layers: u32,
    num_kv_heads: u32,
    num_query_heads: u32,
    head_dim: u32,
    dtype: pb::DType,
    page_size: u32,
) -> pb::Layout {
    pb::Layout {
        num_layers,
        num_kv_heads,
        num_query_heads,
        head_dim,
        dtype: dtype as i32,
        page_size,
        layer_groups: vec![],
    }
}

/// A kvtier client bound to one tenant (the default tenant unless set).
#[derive(Debug, Clone)]
pub struct Client {
    inner: KvTierClient<Channel>,
    channel: Channel,
    tenant: String,
    persist: bool,
    /// `Bearer <token>`, sent with every typed call.
    authorization: Option<AsciiMetadataValue>,
    /// The creation of the sequence calls are meant for (a cluster's
    /// `kvtier-incarnation`), sent with every typed call.
    incarnation: Option<AsciiMetadataValue>,
}

/// How to reach a server that checks tokens or speaks TLS.
#[derive(Debug, Clone, Default)]
pub struct Connect {
    /// Sent as `authorization: Bearer <token>` with every typed call.
    pub token: Option<String>,
    /// TLS (the address must be `https://...`); `None`: plaintext.
    pub tls: Option<Tls>,
}

/// TLS settings for [`Connect::tls`]: what the server's certificate is
/// checked against.
#[derive(Debug, Clone)]
pub struct Tls {
    /// PEM certificates of the authorities the server's certificate must
    /// chain to.
    pub ca_pem: Vec<u8>,
    /// The name the certificate must carry; default: the address's host.
    pub domain: Option<String>,
}

impl Client {
    /// Connects to `addr` (`http://host:port`) through [`Client::endpoint`].
    pub async fn connect(addr: impl Into<String>) -> Result<Self> {
        Self::connect_with(addr, Connect::default()).await
    }

    /// The endpoint a client dials: HTTP/2 windows and frames sized for
    /// megabyte reads (the frame size a client advertises bounds what the
    /// server sends it: 16 KiB by default, a hand-off between threads per
    /// frame).
    pub fn endpoint(addr: impl Into<String>) -> Result<Endpoint> {
        Ok(Endpoint::from_shared(addr.into())?
            .initial_stream_window_size(Some(16 << 20))
            .initial_connection_window_size(Some(32 << 20))
            .max_frame_size((1 << 20) - 1)
            .tcp_nodelay(true))
    }

    /// Connects with a token and/or TLS.
    pub async fn connect_with(addr: impl Into<String>, options: Connect) -> Result<Self> {
        let endpoint = Self::endpoint_with(addr, options.tls)?;
        Self::from_channel(endpoint.connect().await?).with_options_token(options.token.as_deref())
    }

    /// A client that connects on its first call (and again after a lost
    /// connection), with a token and/or TLS.
    pub fn connect_lazy_with(addr: impl Into<String>, options: Connect) -> Result<Self> {
        let endpoint = Self::endpoint_with(addr, options.tls)?;
        Self::from_channel(endpoint.connect_lazy()).with_options_token(options.token.as_deref())
    }

    fn endpoint_with(addr: impl Into<String>, tls: Option<Tls>) -> Result<Endpoint> {
        let mut endpoint = Self::endpoint(addr)?;
        if let Some(tls) = tls {
            let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(tls.ca_pem));
            if let Some(domain) = tls.domain {
                config = config.domain_name(domain);
            }
            endpoint = endpoint.tls_config(config)?;
        }
        Ok(endpoint)
    }

    fn with_options_token(self, token: Option<&str>) -> Result<Self> {
        match token {
            Some(token) => self.with_token(token),
            None => Ok(self),
        }
    }

    /// Sends `token` with every later typed call.
    pub fn with_token(mut self, token: &str) -> Result<Self> {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| ClientError::Token("must be printable ASCII".into()))?;
        self.authorization = Some(value);
        Ok(self)
    }

    /// Registers a new shared-memory region of `bytes` for this client's
    /// tenant, with its token, at the server's shm socket (`--shm-socket`;
    /// it must run on this machine).
    pub async fn register_shm(
        &self,
        socket: &std::path::Path,
        bytes: usize,
    ) -> std::result::Result<ShmRegion, ShmError> {
        let token = self
            .authorization
            .as_ref()
            .and_then(|a| a.to_str().ok())
            .and_then(|a| a.strip_prefix("Bearer "));
        ShmRegion::register(socket, bytes, &self.tenant, token).await
    }

    /// `message` as a request carrying the client's token, for calls made
    /// through [`Client::raw`].
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(auth) = &self.authorization {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        if let Some(incarnation) = &self.incarnation {
            request.metadata_mut().insert(INCARNATION, incarnation.clone());
        }
        request
    }

    /// A client over a channel dialed elsewhere (from [`Client::endpoint`],
    /// say): the default tenant, no token, no persist, messages up to
    /// [`MAX_MESSAGE_BYTES`] both ways.
    pub fn from_channel(channel: Channel) -> Self {
        Self {
            channel: channel.clone(),
            inner: KvTierClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            tenant: String::new(),
            persist: false,
            authorization: None,
            incarnation: None,
        }
    }

    /// With `true`, every later write is acknowledged only once it is on
    /// NVMe and in the manifest (see the response's `durability`).
    pub fn with_persist(mut self, persist: bool) -> Self {
        self.persist = persist;
        self
    }

    /// Uses `tenant` for every later call.
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = tenant.into();
        self
    }

    /// Every later call is meant for this creation of its sequence (0:
    /// any): a cluster node refuses it (NOT_FOUND) once the id has been
    /// created again.
    pub fn with_incarnation(mut self, incarnation: u64) -> Self {
        self.incarnation = (incarnation != 0).then(|| AsciiMetadataValue::from(incarnation));
        self
    }

    /// The generated stub, for anything the typed calls do not cover (wrap
    /// messages with [`Client::request`] to send the token).
    pub fn raw(&mut self) -> &mut KvTierClient<Channel> {
        &mut self.inner
    }

    /// The connection, for calls through another codec (the Python
    /// package's reflection-driven one); requests made with
    /// [`Client::request`] carry the token.
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// Creates `sequence_id` with `layout` (`CreateSequence`). Leading pages
    /// already stored for this tenant, layout and `prefix_hashes` (one hash
    /// per full page; may be empty) are attached, shared; the response says
    /// how many (write on from there) and, in a cluster, the incarnation.
    pub async fn create_sequence(
        &mut self,
        sequence_id: &str,
        layout: pb::Layout,
        prefix_hashes: Vec<Bytes>,
    ) -> Result<pb::CreateSequenceResponse> {
        self.create_in_group(sequence_id, layout, prefix_hashes, None).await
    }

    /// As [`Client::create_sequence`], for shard `group.rank` of a
    /// context-parallel group: in a cluster, a node creates it only where
    /// the group's placement puts that rank (`kvtier_client::Cluster`
    /// creates a group's shards on distinct nodes).
    pub async fn create_in_group(
        &mut self,
        sequence_id: &str,
        layout: pb::Layout,
        prefix_hashes: Vec<Bytes>,
        group: Option<pb::PlacementGroup>,
    ) -> Result<pb::CreateSequenceResponse> {
        let req = pb::CreateSequenceRequest {
            tenant: self.tenant.clone(),
            sequence_id: sequence_id.to_owned(),
            layout: Some(layout),
            prefix_hashes,
            group,
        };
        Ok(self.inner.create_sequence(self.request(req)).await?.into_inner())
    }

    /// Asks the node to move its sequences to their placement
    /// (`DrainNode`, admin): every one, then it leaves, or with `stay` only
    /// those placed elsewhere. Each sequence's move as it ends, then the
    /// totals.
    pub async fn drain_node(
        &mut self,
        node_id: &str,
        parallel: u32,
        stay: bool,
    ) -> Result<tonic::Streaming<pb::DrainProgress>> {
        let req = pb::DrainNodeRequest {
            node_id: node_id.to_owned(),
            parallel,
            stay,
        };
        Ok(self.inner.drain_node(self.request(req)).await?.into_inner())
    }

    /// How many leading pages of a hash chain this server holds for the
    /// client's tenant and `layout` (what a create would attach).
    pub async fn lookup_prefix(&mut self, layout: pb::Layout, prefix_hashes: Vec<Bytes>) -> Result<u64> {
        let req = pb::LookupPrefixRequest {
            tenant: self.tenant.clone(),
            layout: Some(layout),
            prefix_hashes,
        };
        Ok(self.inner.lookup_prefix(self.request(req)).await?.into_inner().pages)
    }

    /// The cluster the server is a node of, as its view has it.
    pub async fn cluster(&mut self) -> Result<pb::ClusterView> {
        let req = pb::GetClusterRequest {};
        Ok(self.inner.get_cluster(self.request(req)).await?.into_inner())
    }

    /// The sequence's layout, length, pages per state and bytes per tier
    /// (`GetSequence`); NOT_FOUND if there is no such sequence.
    pub async fn get_sequence(&mut self, sequence_id: &str) -> Result<pb::SequenceInfo> {
        let req = pb::GetSequenceRequest {
            tenant: self.tenant.clone(),
            sequence_id: sequence_id.to_owned(),
        };
        Ok(self.inner.get_sequence(self.request(req)).await?.into_inner())
    }

    /// Drops the sequence (`DropSequence`), freeing the pages no other
    /// sequence shares; with the NVMe tier, a restart cannot bring it back.
    pub async fn drop_sequence(&mut self, sequence_id: &str) -> Result<()> {
        let req = pb::DropSequenceRequest {
            tenant: self.tenant.clone(),
            sequence_id: sequence_id.to_owned(),
        };
        self.inner.drop_sequence(self.request(req)).await?;
        Ok(())
    }

    /// Writes whole pages of one layer for `kv_heads`, starting at page
    /// `first_page` (which must be where those heads end).
    pub async fn put_pages(
        &mut self,
        sequence_id: &str,
        layer: u32,
        kv_heads: Range<u32>,
        first_page: u32,
        num_tokens: u32,
        kv: Bytes,
    ) -> Result<pb::PutPagesResponse> {
        let write = self.page_write(sequence_id, layer, kv_heads, first_page, num_tokens, kv);
        self.put_page_stream(vec![write]).await
    }

    /// A `PutPages` message for [`Self::put_page_stream`].
    pub fn page_write(
        &self,
        sequence_id: &str,
        layer: u32,
        kv_heads: Range<u32>,
        first_page: u32,
        num_tokens: u32,
        kv: Bytes,
    ) -> pb::PutPagesRequest {
        pb::PutPagesRequest {
            tenant: self.tenant.clone(),
            sequence_id: sequence_id.to_owned(),
            layer,
            kv_head_start: kv_heads.start,
            kv_head_count: kv_heads.len() as u32,
            first_page,
            num_tokens,
            kv,
            persist: self.persist,
        }
    }

    /// Streams many writes in one call (a whole prefill, layer by layer).
    pub async fn put_page_stream(&mut self, writes: Vec<pb::PutPagesRequest>) -> Result<pb::PutPagesResponse> {
        Ok(self
            .inner
            .put_pages(self.request(tokio_stream::iter(writes)))
            .await?
            .into_inner())
    }

    /// Appends `num_tokens` decode tokens of one layer for `kv_heads`. With
    /// `position`, refuses unless the heads hold exactly that many tokens.
    pub async fn append_tokens(
        &mut self,
        sequence_id: &str,
        layer: u32,
        kv_heads: Range<u32>,
        num_tokens: u32,
        kv: Bytes,
        position: Option<u64>,
    ) -> Result<pb::AppendTokensResponse> {
        let req = self.append_request(sequence_id, layer, kv_heads, num_tokens, kv, position);
        Ok(self.inner.append_tokens(self.request(req)).await?.into_inner())
    }

    /// [`Client::append_tokens`]'s request, for [`Client::append_tokens_local`].
    pub fn append_request(
        &self,
        sequence_id: &str,
        layer: u32,
        kv_heads: Range<u32>,
        num_tokens: u32,
        kv: Bytes,
        position: Option<u64>,
    ) -> pb::AppendTokensRequest {
        pb::AppendTokensRequest {
            tenant: self.tenant.clone(),
            sequence_id: sequence_id.to_owned(),
            layer,
            kv_head_start: kv_heads.start,
            kv_head_count: kv_heads.len() as u32,
            num_tokens,
            kv,
            position,
            persist: self.persist,
        }
    }

    /// Runs an `AppendTokens` request over `region`'s own connection
    /// instead of gRPC (the server must be on this machine).
    pub async fn append_tokens_local(
        &self,
        region: &mut ShmRegion,
        mut req: pb::AppendTokensRequest,
    ) -> Result<pb::AppendTokensResponse> {
        if req.tenant.is_empty() {
            req.tenant = self.tenant.clone();
        }
        let reply = local(region, pb::local_call::Call::AppendTokens(req)).await?;
        reply.append_tokens.ok_or_else(|| {
            ClientError::Status(tonic::Status::internal(
                "the server's reply holds no AppendTokens answer",
            ))
        })
    }

    /// Reads pages (every page when `pages` is empty) of one layer for
    /// `kv_heads`, collecting the stream.
    pub async fn fetch_pages(
        &mut self,
        sequence_id: &str,
        layer: u32,
        kv_heads: Range<u32>,
        pages: Vec<u32>,
    ) -> Result<Vec<pb::Page>> {
        let req = pb::FetchPagesRequest {
            tenant: self.tenant.clone(),
            sequence_id: sequence_id.to_owned(),
            layer,
            kv_head_start: kv_heads.start,
            kv_head_count: kv_heads.len() as u32,
            pages,
            ..Default::default()
        };
        self.fetch(req).await
    }

    /// Runs a `FetchPages` request and collects its stream.
    pub async fn fetch(&mut self, mut req: pb::FetchPagesRequest) -> Result<Vec<pb::Page>> {
        if req.tenant.is_empty() {
            req.tenant = self.tenant.clone();
        }
        let mut stream = self.inner.fetch_pages(self.request(req)).await?.into_inner();
        let mut pages = Vec::new();
        while let Some(chunk) = stream.next().await {
            pages.extend(chunk?.pages);
        }
        Ok(pages)
    }

    /// Runs a `FetchPages` request over `region`'s own connection instead of
    /// gRPC (the server must be on this machine): the pages' bytes go to
    /// the request's window of the region, or to the whole region when it
    /// names none.
    pub async fn fetch_local(&self, region: &mut ShmRegion, mut req: pb::FetchPagesRequest) -> Result<Vec<pb::Page>> {
        if req.tenant.is_empty() {
            req.tenant = self.tenant.clone();
        }
        req.shm.get_or_insert_with(|| region.whole());
        let reply = local(region, pb::local_call::Call::FetchPages(req)).await?;
        Ok(reply.fetch_pages.into_iter().flat_map(|m| m.pages).collect())
    }

    /// Applies `action` to pages `pages` of `layers` × `kv_heads`; an empty
    /// page range means every page.
    pub async fn set_page_state(
        &mut self,
        sequence_id: &str,
        layers: Range<u32>,
        kv_heads: Range<u32>,
        pages: Range<u32>,
        action: Action,
    ) -> Result<u64> {
        let req = pb::SetPageStateRequest {
            tenant: self.tenant.clone(),
            sequence_id: sequence_id.to_owned(),
            layer_start: layers.start,
            layer_count: layers.len() as u32,
            kv_head_start: kv_heads.start,
            kv_head_count: kv_heads.len() as u32,
            first_page: pages.start,
            page_count: pages.len() as u32,
            pages: vec![],
            action: Some(action),
        };
        Ok(self.inner.set_page_state(self.request(req)).await?.into_inner().pages)
    }

    fn select_message(&self, sequence_id: &str, req: &SelectRequest) -> pb::SelectPagesRequest {
        pb::SelectPagesRequest {
            tenant: self.tenant.clone(),
            sequence_id: sequence_id.to_owned(),
            layer: req.layer,
            kv_head_start: req.kv_heads.start,
            kv_head_count: req.kv_heads.len() as u32,
            queries: req
                .queries
                .iter()
                .flat_map(|q| q.to_le_bytes())
                .collect::<Vec<u8>>()
                .into(),
            budget_pages: req.budget_pages,
            sink_pages: req.sink_pages,
            window_pages: req.window_pages,
            aggregation: req.aggregation as i32,
            shard: req.shard,
            include_data: req.include_data,
            max_chunk_bytes: 0,
            swap_in: req.swap_in,
            deadline_us: req
                .deadline
                .map_or(0, |d| d.as_micros().clamp(1, u128::from(u32::MAX)) as u32),
            prefetch_pages: req.prefetch_pages,
            lease_ms: req.lease_ms,
            shm: req.shm,
            mode: req.mode as i32,
            candidates: req.candidates,
            softmax_scale: req.softmax_scale,
            top_p: req.top_p,
            min_pages: req.min_pages,
            append: req.append.clone(),
            reuse_similarity: req.reuse_similarity,
            gather_heads: req.gather_heads,
            attend: req.attend,
        }
    }

    /// Chooses the pages `req` needs (ranked as its mode says) and, as asked, makes them hot,
    /// prefetches what comes next, leases them and returns their bytes.
    pub async fn select_pages(&mut self, sequence_id: &str, req: &SelectRequest) -> Result<SelectResult> {
        let msg = self.select_message(sequence_id, req);
        let mut stream = self.inner.select_pages(self.request(msg)).await?.into_inner();
        let mut out = SelectResult::default();
        while let Some(chunk) = stream.next().await {
            out.absorb(chunk?);
        }
        Ok(out)
    }

    /// [`Client::select_pages`] over `region`'s own connection instead of
    /// gRPC (the server must be on this machine); with `include_data`, the
    /// pages' bytes go to `req.shm`, or to the whole region when it names
    /// no window.
    pub async fn select_pages_local(
        &self,
        region: &mut ShmRegion,
        sequence_id: &str,
        req: &SelectRequest,
    ) -> Result<SelectResult> {
        let mut msg = self.select_message(sequence_id, req);
        if msg.include_data {
            msg.shm.get_or_insert_with(|| region.whole());
        }
        let reply = local(region, pb::local_call::Call::SelectPages(msg)).await?;
        let mut out = SelectResult::default();
        reply.select_pages.into_iter().for_each(|m| out.absorb(m));
        Ok(out)
    }

    /// Schedules background promotion of what a speculative query (for a
    /// layer ahead, say) would select; returns the pages queued.
    pub async fn prefetch(&mut self, sequence_id: &str, req: &SelectRequest) -> Result<u32> {
        let msg = self.select_message(sequence_id, req);
        Ok(self.inner.prefetch(self.request(msg)).await?.into_inner().pages_queued)
    }

    /// Ends a lease before it expires.
    pub async fn release_lease(&mut self, lease_id: u64) -> Result<()> {
        self.inner
            .release_lease(self.request(pb::ReleaseLeaseRequest {
                lease_id,
                tenant: self.tenant.clone(),
            }))
            .await?;
        Ok(())
    }

    /// Applies (or, with a trigger, registers) a policy; the request's
    /// tenant and sequence are set from this client and `sequence_id`.
    pub async fn apply_policy(
        &mut self,
        sequence_id: &str,
        mut req: pb::ApplyPolicyRequest,
    ) -> Result<pb::ApplyPolicyResponse> {
        req.tenant = self.tenant.clone();
        req.sequence_id = sequence_id.to_owned();
        Ok(self.inner.apply_policy(self.request(req)).await?.into_inner())
    }

    /// Reports one query's attention per KV head of `kv_heads` (a row of
    /// per-token weights per head, heads one after another).
    pub async fn report_attention(
        &mut self,
        sequence_id: &str,
        layer: u32,
        kv_heads: Range<u32>,
        token_weights: Vec<f32>,
        decay: f64,
    ) -> Result<()> {
        let req = pb::ReportAttentionRequest {
            tenant: self.tenant.clone(),
            sequence_id: sequence_id.to_owned(),
            layer,
            kv_head_start: kv_heads.start,
            kv_head_count: kv_heads.len() as u32,
            token_weights,
            page_weights: vec![],
            decay,
        };
        self.inner.report_attention(self.request(req)).await?;
        Ok(())
    }

    /// The whole server's statistics (a tenant's token gets its tenant's).
    pub async fn stats(&mut self) -> Result<pb::Stats> {
        let req = self.request(pb::GetStatsRequest { tenant: None });
        Ok(self.inner.get_stats(req).await?.into_inner())
    }

    /// The client's tenant's sequences and pages.
    pub async fn tenant_stats(&mut self) -> Result<pb::Stats> {
        let req = self.request(pb::GetStatsRequest {
            tenant: Some(self.tenant.clone()),
        });
        Ok(self.inner.get_stats(req).await?.into_inner())
    }

    /// Starts recording page accesses on the server (for `kvtier tune`):
    /// `sample_rate` of the pages (0: all), up to `max_bytes` (0: the
    /// server's default). The status names the file.
    pub async fn start_access_trace(&mut self, sample_rate: f64, max_bytes: u64) -> Result<pb::AccessTraceStatus> {
        let req = self.request(pb::SetAccessTraceRequest {
            record: true,
            sample_rate,
            max_bytes,
        });
        Ok(self.inner.set_access_trace(req).await?.into_inner())
    }

    /// Stops the server's recording; its final status.
    pub async fn stop_access_trace(&mut self) -> Result<pb::AccessTraceStatus> {
        let req = self.request(pb::SetAccessTraceRequest::default());
        Ok(self.inner.set_access_trace(req).await?.into_inner())
    }
}

/// What to select: one layer, a range of KV heads, their query heads'
/// queries (`[query head][head_dim]`, GQA group after group).
#[derive(Debug, Clone, PartialEq)]
pub struct SelectRequest {
    /// The layer whose pages are ranked.
    pub layer: u32,
    /// The KV heads to select for (a tensor-parallel rank's heads); at least one.
    pub kv_heads: Range<u32>,
    /// Post-RoPE decode queries, finite, for every query head of `kv_heads` in order.
    pub queries: Vec<f32>,
    /// Pages chosen per head, sinks and window included; at least 1.
    pub budget_pages: u32,
    /// The first pages of each lane, always chosen.
    pub sink_pages: u32,
    /// The last (newest) pages of each lane, always chosen; with
    /// `sink_pages`, at most `budget_pages`.
    pub window_pages: u32,
    /// How a GQA group's scores combine per KV head: `Max` is sound for
    /// bounds; `Mean` sums masses; `PerQueryHead` selects per query head;
    /// `Unspecified`: the mode's own (max for quest and cuboid, mean for
    /// sketch and two-stage).
    pub aggregation: pb::Aggregation,
    /// The context-parallel rank calling and which pages it owns; `None`: not sharded.
    pub shard: Option<pb::ContextShard>,
    /// Also return the chosen pages' bytes (gone pages never).
    pub include_data: bool,
    /// Make the chosen pages hot in one swap-in.
    pub swap_in: bool,
    /// With `swap_in`: answer by then; late pages come back cold.
    pub deadline: Option<std::time::Duration>,
    /// Promote the next-ranked pages in the background, up to this many per head.
    pub prefetch_pages: u32,
    /// Pin the chosen pages this long (0: no lease).
    pub lease_ms: u32,
    /// With `include_data`: the pages' bytes go to this window of a
    /// registered [`crate::ShmRegion`] instead of the messages.
    pub shm: Option<pb::ShmWindow>,
    /// How pages are ranked; `Unspecified`: the server's default.
    pub mode: pb::SelectionMode,
    /// Two-stage: stage one keeps `candidates ×` the budget (0: 4).
    pub candidates: u32,
    /// Softmax scale of estimated logits (0: `1/√head_dim`).
    pub softmax_scale: f32,
    /// Top-p budget (sketch, two-stage): stop once the chosen pages hold
    /// this share of the estimated mass, with at least `min_pages` (0: off).
    pub top_p: f32,
    /// With `top_p`: the fewest pages chosen.
    pub min_pages: u32,
    /// A decode step's own tokens for these (layer, KV heads), appended by
    /// the same call once the selection is made (which leaves them out).
    pub append: Option<pb::AppendAfterSelection>,
    /// Reuse each lane's last ranking while every query head's cosine
    /// similarity to the query that made it is at least this (0: rank
    /// every time).
    pub reuse_similarity: f32,
    /// With `shm`: each KV head's pages go into the window as one run of K
    /// rows then one of V rows (each page's V rows at its `shm_v_offset`).
    pub gather_heads: bool,
    /// Attend in the store: the answer's [`SelectResult::attention`] holds
    /// each query head's attention over its chosen pages, and no page
    /// comes back (needs `include_data` and `shm` unset).
    pub attend: bool,
}

impl SelectRequest {
    /// Budget `budget_pages` with no sinks, no window, the mode's own
    /// aggregation.
    pub fn new(layer: u32, kv_heads: Range<u32>, queries: Vec<f32>, budget_pages: u32) -> Self {
        Self {
            layer,
            kv_heads,
            queries,
            budget_pages,
            sink_pages: 0,
            window_pages: 0,
            aggregation: pb::Aggregation::Unspecified,
            shard: None,
            include_data: false,
            swap_in: false,
            deadline: None,
            prefetch_pages: 0,
            lease_ms: 0,
            shm: None,
            mode: pb::SelectionMode::Unspecified,
            candidates: 0,
            softmax_scale: 0.0,
            top_p: 0.0,
            min_pages: 0,
            append: None,
            reuse_similarity: 0.0,
            gather_heads: false,
            attend: false,
        }
    }

    /// The request a `SelectPagesRequest` message makes (what
    /// [`Client::select_pages`] sends, read back; its tenant and sequence
    /// are the client's): for callers that have the message, such as the
    /// Python package's merge of a partitioned selection.
    pub fn from_message(m: &pb::SelectPagesRequest) -> Self {
        Self {
            layer: m.layer,
            kv_heads: m.kv_head_start..m.kv_head_start.saturating_add(m.kv_head_count),
            queries: m
                .queries
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            budget_pages: m.budget_pages,
            sink_pages: m.sink_pages,
            window_pages: m.window_pages,
            aggregation: pb::Aggregation::try_from(m.aggregation).unwrap_or(pb::Aggregation::Unspecified),
            shard: m.shard,
            include_data: m.include_data,
            swap_in: m.swap_in,
            deadline: (m.deadline_us > 0).then(|| std::time::Duration::from_micros(u64::from(m.deadline_us))),
            prefetch_pages: m.prefetch_pages,
            lease_ms: m.lease_ms,
            shm: m.shm,
            mode: pb::SelectionMode::try_from(m.mode).unwrap_or_default(),
            candidates: m.candidates,
            softmax_scale: m.softmax_scale,
            top_p: m.top_p,
            min_pages: m.min_pages,
            append: m.append.clone(),
            reuse_similarity: m.reuse_similarity,
            gather_heads: m.gather_heads,
            attend: m.attend,
        }
    }
}

/// A selection's answer, collected from all of its response messages.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SelectResult {
    /// Per KV head (per query head with `PerQueryHead`): the chosen pages in
    /// position order, with score and state, and how many are gone.
    pub heads: Vec<pb::HeadSelection>,
    /// With `include_data`: the chosen pages that are not gone.
    pub pages: Vec<pb::Page>,
    /// Pages the server ranked, over all heads.
    pub pages_scored: u64,
    /// Index bytes read: digests, and sketch rows.
    pub digest_bytes: u64,
    /// Lanes chosen from their last ranking instead of ranked.
    pub lanes_reused: u32,
    /// The mode that ranked.
    pub mode: pb::SelectionMode,
    /// With `swap_in`: where the pages came from and the time per source
    /// (zeros without one, and past a deadline).
    pub swap: pb::SwapReport,
    /// Where the server spent the call's time.
    pub timing: pb::SelectTiming,
    /// Pages queued for background promotion (`prefetch_pages`).
    pub prefetch_queued: u32,
    /// (lease id, milliseconds until it expires).
    pub lease: Option<(u64, u64)>,
    /// With [`SelectRequest::append`]: what the append did.
    pub appended: Option<pb::AppendTokensResponse>,
    /// With [`SelectRequest::attend`]: each query head's attention over
    /// its chosen pages, in query-head order.
    pub attention: Vec<pb::QueryAttention>,
}

/// `call` over `region`'s own connection: the reply, or the server's
/// refusal.
async fn local(region: &mut ShmRegion, call: pb::local_call::Call) -> Result<pb::LocalReply> {
    Ok(region
        .call(&pb::LocalCall {
            call: Some(call),
            ..Default::default()
        })
        .await??)
}

impl SelectResult {
    /// Adds one of the call's response messages.
    fn absorb(&mut self, chunk: pb::SelectPagesResponse) {
        self.heads.extend(chunk.heads);
        self.pages_scored += chunk.pages_scored;
        self.digest_bytes += chunk.digest_bytes;
        self.lanes_reused += chunk.lanes_reused;
        self.pages.extend(chunk.pages);
        if let Some(swap) = chunk.swap {
            self.swap = swap;
        }
        if let Some(timing) = chunk.timing {
            self.timing = timing;
            self.mode = pb::SelectionMode::try_from(chunk.mode).unwrap_or_default();
        }
        self.prefetch_queued += chunk.prefetch_queued;
        if chunk.lease_id != 0 {
            self.lease = Some((chunk.lease_id, chunk.lease_expires_in_ms));
        }
        if chunk.appended.is_some() {
            self.appended = chunk.appended;
        }
        self.attention.extend(chunk.attention);
    }
}

/// Actions for [`Client::set_page_state`].
pub mod actions {
    use crate::pb;
    use crate::pb::set_page_state_request::Action;

    /// Hot → cold in host memory.
    pub fn offload_to_host() -> Action {
        Action::Offload(pb::Offload {
            tier: pb::Tier::Host as i32,
        })
    }
    /// Hot → cold on NVMe.
    pub fn offload_to_nvme() -> Action {
        Action::Offload(pb::Offload {
            tier: pb::Tier::Nvme as i32,
        })
    }
    /// Cold in host memory → cold on NVMe.
    pub fn migrate_to_nvme() -> Action {
        Action::Migrate(pb::Migrate {
            tier: pb::Tier::Nvme as i32,
        })
    }
    /// Cold → hot.
    pub fn swap_in() -> Action {
        Action::SwapIn(pb::SwapIn {})
    }
    /// Hot or cold → a summary of `rows` rows (at least 1), each the mean
    /// key and value of a run of consecutive tokens; the originals are lost.
    pub fn summarize(rows: u32) -> Action {
        Action::Summarize(pb::Summarize { rows })
    }
    /// Hot, cold or summary → gone, for good.
    pub fn evict() -> Action {
        Action::Evict(pb::Evict {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_select_request_reads_back_from_the_message_it_sends() {
        let client = Client::from_channel(Endpoint::from_static("http://127.0.0.1:1").connect_lazy());
        let req = SelectRequest {
            sink_pages: 1,
            window_pages: 2,
            aggregation: pb::Aggregation::Mean,
            shard: Some(pb::ContextShard {
                rank: 1,
                world: 2,
                ownership: pb::Ownership::Strided as i32,
                scope: pb::Scope::Global as i32,
            }),
            include_data: true,
            swap_in: true,
            deadline: Some(std::time::Duration::from_micros(250)),
            prefetch_pages: 3,
            lease_ms: 40,
            mode: pb::SelectionMode::Cuboid,
            candidates: 8,
            softmax_scale: 0.5,
            top_p: 0.9,
            min_pages: 2,
            ..SelectRequest::new(4, 1..3, vec![1.5, -2.0, 0.25, 8.0], 7)
        };
        let message = client.select_message("s", &req);
        let back = SelectRequest::from_message(&message);
        assert_eq!(back, req);
    }
}
