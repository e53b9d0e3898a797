//! `kvtier.v1.KvTier` handlers: validate, convert, call the store on a
//! blocking thread, map errors. No logic of their own.

use std::ops::Range;
use std::sync::Arc;

use kvtier_cluster::Node;
use kvtier_core::placement::PlacementKey;
use kvtier_core::rank::Ranking;
use kvtier_core::select::{Aggregation, Budget, Shard};
use kvtier_core::{Layout, Reason, SequenceKey, TenantId, wire};
use kvtier_proto::v1 as pb;
use kvtier_proto::v1::kv_tier_server::KvTier;
use kvtier_store::{
    AppendOutcome, AppendTokens, ApplyPolicy, AttentionWeights, FetchCursor, PageSelection, PutPages, ReportAttention,
    SelectPages, Selection, SetPageState, Store, StoreError, StoreResult,
};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::Caller;
use crate::blocking::{blocking, may_wait, sized};
use crate::gate::RequestBytes;
use crate::inflight::{Holding, InFlight};
use crate::responses::{
    FetchJob, FetchStream, SelectStream, holding, index_scanned, page_messages, select_into, select_messages,
    send_chunks,
};
use crate::shm::{LocalCalls, Regions, Window};
use crate::status::{field_status, invalid, refused, to_status};
use crate::{chunk, convert};

#[derive(Debug, Clone)]
pub(crate) struct KvTierService {
    store: Arc<Store>,
    /// The server's message limit, which no response message passes.
    max_message_bytes: usize,
    /// What response data holds in memory until it is sent.
    in_flight: Arc<InFlight>,
    /// Shared-memory regions for the shm data plane.
    regions: Arc<Regions>,
    traces: Arc<TraceSettings>,
    /// The node's membership, in a cluster.
    cluster: Option<Arc<Node>>,
}

/// Where `SetAccessTrace` records, and its default size bound.
#[derive(Debug, Clone)]
pub(crate) struct TraceSettings {
    pub(crate) dir: Option<std::path::PathBuf>,
    pub(crate) max_bytes: u64,
}

/// A call for a sequence: the caller, the incarnation of the sequence the
/// call is meant for (`kvtier-incarnation` metadata, sent by cluster
/// clients), and the message.
fn open_seq<T>(request: Request<T>) -> Result<(Caller, Option<u64>, T), Status> {
    let incarnation = match request.metadata().get(kvtier_cluster::INCARNATION) {
        None => None,
        Some(v) => Some(v.to_str().ok().and_then(|v| v.parse().ok()).ok_or_else(|| {
            Status::invalid_argument(format!("{}: not a decimal incarnation", kvtier_cluster::INCARNATION))
        })?),
    };
    let (caller, message) = open(request)?;
    Ok((caller, incarnation, message))
}

/// The caller the gate resolved, and the message.
fn open<T>(request: Request<T>) -> Result<(Caller, T), Status> {
    let caller = request
        .extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::internal("the call did not pass the gate"))?;
    Ok((caller, request.into_inner()))
}

/// A request's tenant, if the caller may act for it.
fn tenant(caller: &Caller, name: &str) -> Result<TenantId, Status> {
    let tenant = TenantId::parse(wire::TENANT.path, name).map_err(field_status)?;
    caller.check_tenant(&tenant)?;
    Ok(tenant)
}

impl KvTierService {
    pub(crate) fn new(
        store: Arc<Store>,
        max_message_bytes: usize,
        in_flight: Arc<InFlight>,
        regions: Arc<Regions>,
        traces: TraceSettings,
        cluster: Option<Arc<Node>>,
    ) -> Self {
        Self {
            store,
            max_message_bytes,
            in_flight,
            regions,
            traces: Arc::new(traces),
            cluster,
        }
    }

    /// A request's sequence, if the caller may act for its tenant and, in
    /// a cluster, this node may serve the sequences it holds.
    fn key(&self, caller: &Caller, tenant: &str, sequence_id: &str) -> Result<SequenceKey, Status> {
        let key = convert::key(tenant, sequence_id)?;
        caller.check_tenant(&key.tenant)?;
        if let Some(node) = &self.cluster {
            node.check_serving().map_err(refused)?;
        }
        Ok(key)
    }

    /// In a cluster, for a sequence this node does not hold: where it is
    /// instead (another node, a node that is out, lost), as the call's
    /// status, and the sequence's key. With the incarnation a call is meant for, a later creation of the
    /// id is refused (NOT_FOUND) rather than served.
    ///
    /// The caller's right to the tenant is checked first: a refusal must
    /// not tell a caller where another tenant's sequences are.
    async fn located(
        &self,
        caller: &Caller,
        tenant: &str,
        sequence_id: &str,
        incarnation: Option<u64>,
    ) -> Result<SequenceKey, Status> {
        let key = self.key(caller, tenant, sequence_id)?;
        let Some(node) = &self.cluster else { return Ok(key) };
        if !self.store.holds(&key) {
            node.whereabouts(&key, incarnation).await.map_err(refused)?;
        } else if let Some(expected) = incarnation {
            node.check_incarnation(&key, expected).map_err(refused)?;
        }
        Ok(key)
    }

    async fn call<T, F>(&self, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Arc<Store>) -> StoreResult<T> + Send + 'static,
    {
        blocking(Arc::clone(&self.store), f).await
    }
}

/// The parts of a selection request that need converting.
struct SelectionInputs {
    queries: Vec<f32>,
    aggregation: Aggregation,
    shard: Option<Shard>,
    ranking: Ranking,
}

fn selection_inputs(r: &pb::SelectPagesRequest) -> Result<SelectionInputs, Status> {
    if r.lease_ms as u128 > kvtier_store::MAX_LEASE.as_millis() {
        return Err(invalid(
            wire::LEASE_MS,
            format!(
                "is {}, at most {} allowed",
                r.lease_ms,
                kvtier_store::MAX_LEASE.as_millis()
            ),
        ));
    }
    if r.deadline_us > 0 && !r.swap_in {
        return Err(invalid(wire::DEADLINE_US, "applies to a swap-in; set swap_in too"));
    }
    Ok(SelectionInputs {
        queries: convert::f32s(wire::QUERIES, &r.queries)?,
        aggregation: convert::aggregation(r.aggregation)?,
        shard: convert::shard(r.shard)?,
        ranking: convert::ranking(r)?,
    })
}

fn select_request<'a>(r: &pb::SelectPagesRequest, inputs: &'a SelectionInputs) -> SelectPages<'a> {
    let millis = |ms: u32| (ms > 0).then(|| std::time::Duration::from_millis(u64::from(ms)));
    SelectPages {
        layer: r.layer,
        heads: convert::heads(r.kv_head_start, r.kv_head_count),
        queries: &inputs.queries,
        budget: Budget {
            pages: r.budget_pages as usize,
            sinks: r.sink_pages as usize,
            window: r.window_pages as usize,
        },
        aggregation: inputs.aggregation,
        ranking: inputs.ranking,
        shard: inputs.shard,
        with_data: r.include_data,
        swap_in: r.swap_in,
        deadline: (r.deadline_us > 0).then(|| std::time::Duration::from_micros(u64::from(r.deadline_us))),
        prefetch_pages: r.prefetch_pages as usize,
        lease: millis(r.lease_ms),
    }
}

/// A selection, checked and ready to run: refused before it moves
/// anything.
pub(crate) struct SelectCall {
    key: SequenceKey,
    request: pb::SelectPagesRequest,
    inputs: SelectionInputs,
    window: Option<Window>,
    /// The most page bytes it can return.
    bound: usize,
    /// Index bytes it scans.
    scanned: usize,
    /// The limit on one response message.
    limit: usize,
}

impl SelectCall {
    /// Whether its page bytes travel in the messages.
    fn data_inline(&self) -> bool {
        self.request.include_data && self.window.is_none()
    }

    /// Bytes it scans and copies, for where it runs.
    fn work(&self) -> usize {
        // A swap-in copies pages to the device and may wait for its
        // deadline: never on a runtime worker.
        match self.request.swap_in {
            true => usize::MAX,
            false => self.scanned.saturating_add(self.room()),
        }
    }

    fn room(&self) -> usize {
        if self.request.include_data { self.bound } else { 0 }
    }

    fn run(mut self, store: &Arc<Store>) -> StoreResult<(Selection<Range<usize>>, Vec<pb::Page>)> {
        let room = self.room();
        let req = select_request(&self.request, &self.inputs);
        select_into(store, &self.key, req, self.window.as_mut(), room)
    }
}

impl KvTierService {
    /// The sequence's shape as of its last write; a write under way is
    /// waited for off the runtime's workers, so that the call is sized for
    /// what it will read.
    fn shape(&self, key: &SequenceKey) -> Result<(Arc<Layout>, u64), Status> {
        let shape = || self.store.shape(key).map_err(to_status);
        match self.store.would_wait(key) {
            true => may_wait(shape),
            false => shape(),
        }
    }

    /// A fetch, checked: its job, and the shm window it names, checked
    /// against the region for everything the fetch can read.
    fn plan_fetch(
        &self,
        caller: &Caller,
        mut r: pb::FetchPagesRequest,
        request_bytes: Option<RequestBytes>,
    ) -> Result<(FetchJob, Option<Window>), Status> {
        let key = self.key(caller, &r.tenant, &r.sequence_id)?;
        let max_bytes = chunk::limit(r.max_chunk_bytes, self.max_message_bytes)?;
        if !r.pages.is_empty() && !r.per_head_pages.is_empty() {
            return Err(invalid(
                wire::PER_HEAD_PAGES,
                "give either pages or per_head_pages, not both",
            ));
        }
        let shm = r.shm.take();
        let shape = self.shape(&key)?;
        let job = FetchJob::new(request_bytes, key, r, max_bytes, &shape);
        let window = match shm {
            Some(w) => Some(self.regions.window(&job.key.tenant, &w, job.bound)?),
            None => None,
        };
        Ok((job, window))
    }

    /// A selection, checked, with its shm window if it names one.
    fn plan_select(&self, caller: &Caller, mut r: pb::SelectPagesRequest) -> Result<SelectCall, Status> {
        let key = self.key(caller, &r.tenant, &r.sequence_id)?;
        let limit = chunk::limit(r.max_chunk_bytes, self.max_message_bytes)?;
        let inputs = selection_inputs(&r)?;
        let shm = r.shm.take();
        if shm.is_some() && !r.include_data {
            return Err(invalid(wire::SHM, "carries page bytes; set include_data too"));
        }
        let shape = self.shape(&key)?;
        let scanned = index_scanned(r.kv_head_count, r.budget_pages, &inputs.ranking, &shape);
        let bound = kvtier_store::data_bound(&shape.0, shape.1, r.budget_pages, r.kv_head_count, inputs.aggregation);
        let window = match &shm {
            Some(w) => Some(self.regions.window(&key.tenant, w, bound)?),
            None if r.include_data => {
                chunk::check_page_fits(shape.0.page_bytes(), limit)?;
                None
            }
            None => None,
        };
        Ok(SelectCall {
            key,
            request: r,
            inputs,
            window,
            bound,
            scanned,
            limit,
        })
    }

    /// A selection's response messages; a lease it took is given back if
    /// they cannot be made.
    fn selection_messages(
        &self,
        tenant: &TenantId,
        selection: Selection<Range<usize>>,
        data: Vec<pb::Page>,
        limit: usize,
    ) -> Result<Vec<pb::SelectPagesResponse>, Status> {
        let lease = selection.lease;
        let messages = select_messages(selection, data, limit);
        if let (Err(_), Some((id, _))) = (&messages, lease) {
            self.store.release_lease(tenant, id);
        }
        messages
    }
}

fn append(store: &Store, key: &SequenceKey, r: &pb::AppendTokensRequest) -> StoreResult<AppendOutcome> {
    store.append_tokens(
        key,
        AppendTokens {
            layer: r.layer,
            heads: convert::heads(r.kv_head_start, r.kv_head_count),
            num_tokens: r.num_tokens,
            kv: &r.kv,
            expected_position: r.position,
            persist: r.persist,
        },
    )
}

fn append_to_pb(outcome: &AppendOutcome) -> pb::AppendTokensResponse {
    pb::AppendTokensResponse {
        tokens: outcome.tokens,
        pages_opened: outcome.pages_opened,
        durability: convert::durability_to_pb(outcome.durability) as i32,
        timing: Some(convert::append_timing_to_pb(&outcome.timing)),
    }
}

/// Calls over the shm socket: the gRPC calls' own checks and store calls,
/// run on the connection's thread (never a runtime worker, so an append
/// that migrates host pages to NVMe may take its time here).
impl LocalCalls for KvTierService {
    fn fetch_pages(&self, caller: &Caller, r: pb::FetchPagesRequest) -> Result<Vec<pb::FetchPagesResponse>, Status> {
        let (job, window) = self.plan_fetch(caller, r, None)?;
        let Some(mut window) = window else {
            return Err(invalid(
                wire::SHM,
                "is required over the shm socket, which carries no page bytes",
            ));
        };
        let pages = job.read_to_window(&self.store, &mut window).map_err(to_status)?;
        page_messages(pages, job.max_bytes)
    }

    fn select_pages(&self, caller: &Caller, r: pb::SelectPagesRequest) -> Result<Vec<pb::SelectPagesResponse>, Status> {
        let call = self.plan_select(caller, r)?;
        if call.data_inline() {
            return Err(invalid(
                wire::SHM,
                "is required with include_data over the shm socket, which carries no page bytes",
            ));
        }
        let (tenant, limit) = (call.key.tenant.clone(), call.limit);
        let (selection, data) = call.run(&self.store).map_err(to_status)?;
        self.selection_messages(&tenant, selection, data, limit)
    }

    fn append_tokens(&self, caller: &Caller, r: pb::AppendTokensRequest) -> Result<pb::AppendTokensResponse, Status> {
        let key = self.key(caller, &r.tenant, &r.sequence_id)?;
        let outcome = append(&self.store, &key, &r).map_err(to_status)?;
        Ok(append_to_pb(&outcome))
    }
}

#[tonic::async_trait]
impl KvTier for KvTierService {
    async fn create_sequence(
        &self,
        request: Request<pb::CreateSequenceRequest>,
    ) -> Result<Response<pb::CreateSequenceResponse>, Status> {
        let (caller, r) = open(request)?;
        let key = self.key(&caller, &r.tenant, &r.sequence_id)?;
        let layout = convert::layout(r.layout)?;
        let hashes: Vec<Vec<u8>> = r.prefix_hashes.into_iter().map(|h| h.to_vec()).collect();
        let incarnation = match &self.cluster {
            Some(node) => {
                let placement = PlacementKey::of(key.tenant.as_str(), key.sequence.as_str(), &hashes);
                node.claim(&key, placement).await.map_err(refused)?
            }
            None => 0,
        };
        let claimed = key.clone();
        let created = self.call(move |s| s.create_sequence(key, layout, hashes)).await;
        let created = match (created, &self.cluster) {
            (Ok(created), _) => created,
            // ALREADY_EXISTS: the sequence is here, and so is its claim.
            (Err(e), Some(node)) if e.code() != tonic::Code::AlreadyExists => {
                if let Err(etcd) = node.release(&claimed).await {
                    tracing::warn!(error = %etcd, "could not release the claim of a sequence whose create failed");
                }
                return Err(e);
            }
            (Err(e), _) => return Err(e),
        };
        Ok(Response::new(pb::CreateSequenceResponse {
            attached_pages: created.attached_pages,
            info: Some(pb::SequenceInfo {
                incarnation,
                ..convert::info_to_pb(&created.info)
            }),
            incarnation,
        }))
    }

    async fn get_sequence(
        &self,
        request: Request<pb::GetSequenceRequest>,
    ) -> Result<Response<pb::SequenceInfo>, Status> {
        let (caller, incarnation, r) = open_seq(request)?;
        let key = self.located(&caller, &r.tenant, &r.sequence_id, incarnation).await?;
        let incarnation = self.cluster.as_ref().and_then(|n| n.incarnation(&key)).unwrap_or(0);
        let info = self.call(move |s| s.sequence_info(&key)).await?;
        Ok(Response::new(pb::SequenceInfo {
            incarnation,
            ..convert::info_to_pb(&info)
        }))
    }

    async fn drop_sequence(
        &self,
        request: Request<pb::DropSequenceRequest>,
    ) -> Result<Response<pb::DropSequenceResponse>, Status> {
        let (caller, incarnation, r) = open_seq(request)?;
        let key = self.located(&caller, &r.tenant, &r.sequence_id, incarnation).await?;
        let dropped = key.clone();
        self.call(move |s| s.drop_sequence(&key)).await?;
        if let Some(node) = &self.cluster
            && let Err(e) = node.release(&dropped).await
        {
            // The record names this node and a sequence it no longer
            // holds: a later create here reclaims it, a read gets NOT_FOUND.
            tracing::warn!(error = %e, "could not release the ownership record of a dropped sequence");
        }
        Ok(Response::new(pb::DropSequenceResponse {}))
    }

    async fn put_pages(
        &self,
        request: Request<Streaming<pb::PutPagesRequest>>,
    ) -> Result<Response<pb::PutPagesResponse>, Status> {
        let (caller, incarnation, mut stream) = open_seq(request)?;
        let mut total = pb::PutPagesResponse::default();
        let mut weakest: Option<pb::Durability> = None;
        while let Some(r) = stream.message().await? {
            let write = total.writes;
            let numbered = |e: Status| Status::new(e.code(), format!("write {write}: {}", e.message()));
            let key = self
                .located(&caller, &r.tenant, &r.sequence_id, incarnation)
                .await
                .map_err(numbered)?;
            let outcome = self
                .call(move |s| {
                    s.put_pages(
                        &key,
                        PutPages {
                            layer: r.layer,
                            heads: convert::heads(r.kv_head_start, r.kv_head_count),
                            first_page: r.first_page,
                            num_tokens: r.num_tokens,
                            kv: &r.kv,
                            persist: r.persist,
                        },
                    )
                })
                .await
                .map_err(numbered)?;
            let d = convert::durability_to_pb(outcome.durability);
            weakest = Some(weakest.map_or(d, |w| w.min(d)));
            total.pages_written += outcome.pages_written;
            total.pages_shared += outcome.pages_shared;
            total.writes += 1;
        }
        total.durability = weakest.unwrap_or(pb::Durability::Memory) as i32;
        Ok(Response::new(total))
    }

    async fn append_tokens(
        &self,
        request: Request<pb::AppendTokensRequest>,
    ) -> Result<Response<pb::AppendTokensResponse>, Status> {
        let (caller, incarnation, r) = open_seq(request)?;
        let key = self.located(&caller, &r.tenant, &r.sequence_id, incarnation).await?;
        let outcome = self.call(move |s| append(s, &key, &r)).await?;
        Ok(Response::new(append_to_pb(&outcome)))
    }

    type FetchPagesStream = FetchStream;

    async fn fetch_pages(&self, request: Request<pb::FetchPagesRequest>) -> Result<Response<FetchStream>, Status> {
        // The request lives as long as its stream, and so does its charge.
        let request_bytes = request.extensions().get::<RequestBytes>().cloned();
        let (caller, incarnation, r) = open_seq(request)?;
        self.located(&caller, &r.tenant, &r.sequence_id, incarnation).await?;
        let (job, window) = self.plan_fetch(&caller, r, request_bytes)?;
        let (tx, rx) = mpsc::channel(1);
        if let Some(mut window) = window {
            // The bytes go to the client's memory, so none are held here in
            // flight.
            let (key, bound, max_bytes) = (job.key.clone(), job.bound, job.max_bytes);
            let pages = sized(&self.store, &key, bound, move |s| job.read_to_window(s, &mut window)).await?;
            let messages = holding(page_messages(pages, max_bytes)?, None);
            return Ok(Response::new(Holding::new(
                tokio_stream::iter(messages).chain(ReceiverStream::new(rx)),
            )));
        }
        let job = Arc::new(job);
        let max_bytes = job.max_bytes;
        // The first chunk is read before the stream starts, so a bad request
        // fails the call itself rather than the stream.
        let held = self.in_flight.hold("a fetch chunk", job.room).await?;
        let (first, next) = {
            let reader = Arc::clone(&job);
            sized(&self.store, &job.key, job.room, move |s| {
                reader.read(s, FetchCursor::default())
            })
            .await?
        };
        let first = holding(page_messages(first, max_bytes)?, Some(held));
        if let Some(from) = next {
            let (store, in_flight) = (Arc::clone(&self.store), Arc::clone(&self.in_flight));
            tokio::spawn(send_chunks(store, in_flight, job, from, tx));
        }
        Ok(Response::new(Holding::new(
            tokio_stream::iter(first).chain(ReceiverStream::new(rx)),
        )))
    }

    type SelectPagesStream = SelectStream;

    async fn select_pages(&self, request: Request<pb::SelectPagesRequest>) -> Result<Response<SelectStream>, Status> {
        let (caller, incarnation, r) = open_seq(request)?;
        self.located(&caller, &r.tenant, &r.sequence_id, incarnation).await?;
        let call = self.plan_select(&caller, r)?;
        // The data's room in flight, at most what the selection can choose,
        // is taken before the store reads any of it. Data over shm goes to
        // the client's memory: nothing held in flight.
        let held = match call.data_inline() {
            true => Some(self.in_flight.hold("a selection's data", call.bound).await?),
            false => None,
        };
        let (key, limit, work) = (call.key.clone(), call.limit, call.work());
        let (selection, data) = sized(&self.store, &key, work, move |s| call.run(s)).await?;
        let messages = self.selection_messages(&key.tenant, selection, data, limit)?;
        Ok(Response::new(Holding::new(tokio_stream::iter(holding(messages, held)))))
    }

    async fn prefetch(
        &self,
        request: Request<pb::SelectPagesRequest>,
    ) -> Result<Response<pb::PrefetchResponse>, Status> {
        let (caller, incarnation, r) = open_seq(request)?;
        let key = self.located(&caller, &r.tenant, &r.sequence_id, incarnation).await?;
        for (set, field) in [
            (r.include_data, wire::INCLUDE_DATA.path),
            (r.swap_in, wire::SWAP_IN.path),
            (r.deadline_us > 0, wire::DEADLINE_US.path),
            (r.lease_ms > 0, wire::LEASE_MS.path),
        ] {
            if set {
                return Err(invalid(
                    field,
                    "must be unset for Prefetch, which only schedules promotions",
                ));
            }
        }
        let inputs = selection_inputs(&r)?;
        let pages_queued = self
            .call(move |s| s.prefetch_query(&key, select_request(&r, &inputs)))
            .await?;
        Ok(Response::new(pb::PrefetchResponse { pages_queued }))
    }

    async fn release_lease(
        &self,
        request: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        let (caller, r) = open(request)?;
        let tenant = tenant(&caller, &r.tenant)?;
        let id = r.lease_id;
        if self.call(move |s| Ok(s.release_lease(&tenant, id))).await? {
            Ok(Response::new(pb::ReleaseLeaseResponse {}))
        } else {
            Err(to_status(StoreError::NotFound {
                what: format!("lease {id}"),
            }))
        }
    }

    async fn set_page_state(
        &self,
        request: Request<pb::SetPageStateRequest>,
    ) -> Result<Response<pb::SetPageStateResponse>, Status> {
        let (caller, incarnation, r) = open_seq(request)?;
        let key = self.located(&caller, &r.tenant, &r.sequence_id, incarnation).await?;
        let (action, summary_rows) = convert::action(r.action)?;
        if !r.pages.is_empty() && (r.first_page != 0 || r.page_count != 0) {
            return Err(invalid(
                wire::PAGES,
                "give either pages or first_page/page_count, not both",
            ));
        }
        let outcome = self
            .call(move |s| {
                s.set_page_state(
                    &key,
                    SetPageState {
                        layer_start: r.layer_start,
                        layer_count: r.layer_count,
                        heads: convert::heads(r.kv_head_start, r.kv_head_count),
                        pages: if r.pages.is_empty() {
                            PageSelection::Range {
                                first: r.first_page,
                                count: r.page_count,
                            }
                        } else {
                            PageSelection::List(&r.pages)
                        },
                        action,
                        summary_rows,
                        reason: Reason::Explicit,
                    },
                )
            })
            .await?;
        Ok(Response::new(pb::SetPageStateResponse { pages: outcome.pages }))
    }

    async fn apply_policy(
        &self,
        request: Request<pb::ApplyPolicyRequest>,
    ) -> Result<Response<pb::ApplyPolicyResponse>, Status> {
        let (caller, incarnation, r) = open_seq(request)?;
        let key = self.located(&caller, &r.tenant, &r.sequence_id, incarnation).await?;
        let Some((spec, trigger)) = crate::policy::spec(&r)? else {
            self.call(move |s| s.unregister_policy(&key)).await?;
            return Ok(Response::new(pb::ApplyPolicyResponse::default()));
        };
        let queries = convert::f32s(wire::QUERIES, &r.queries)?;
        let outcome = self
            .call(move |s| {
                s.apply_policy(
                    &key,
                    ApplyPolicy {
                        spec: &spec,
                        queries: &queries,
                        trigger,
                    },
                )
            })
            .await?;
        Ok(Response::new(pb::ApplyPolicyResponse {
            pages_kept: outcome.kept,
            pages_changed: outcome.changed,
            dropped_mass: outcome.dropped_mass,
        }))
    }

    async fn report_attention(
        &self,
        request: Request<pb::ReportAttentionRequest>,
    ) -> Result<Response<pb::ReportAttentionResponse>, Status> {
        let (caller, incarnation, r) = open_seq(request)?;
        let key = self.located(&caller, &r.tenant, &r.sequence_id, incarnation).await?;
        if r.token_weights.is_empty() == r.page_weights.is_empty() {
            return Err(invalid(
                wire::TOKEN_WEIGHTS,
                "give either token_weights or page_weights",
            ));
        }
        self.call(move |s| {
            s.report_attention(
                &key,
                ReportAttention {
                    layer: r.layer,
                    heads: convert::heads(r.kv_head_start, r.kv_head_count),
                    weights: if r.page_weights.is_empty() {
                        AttentionWeights::Tokens(&r.token_weights)
                    } else {
                        AttentionWeights::Pages(&r.page_weights)
                    },
                    decay: (r.decay != 0.0).then_some(r.decay),
                },
            )
        })
        .await?;
        Ok(Response::new(pb::ReportAttentionResponse {}))
    }

    async fn lookup_prefix(
        &self,
        request: Request<pb::LookupPrefixRequest>,
    ) -> Result<Response<pb::LookupPrefixResponse>, Status> {
        let (caller, r) = open(request)?;
        let tenant = tenant(&caller, &r.tenant)?;
        let layout = convert::layout(r.layout)?;
        let hashes = r.prefix_hashes.into_iter().map(|h| h.to_vec()).collect();
        let pages = self.call(move |s| s.lookup_prefix(&tenant, layout, hashes)).await?;
        Ok(Response::new(pb::LookupPrefixResponse { pages }))
    }

    async fn get_cluster(&self, request: Request<pb::GetClusterRequest>) -> Result<Response<pb::ClusterView>, Status> {
        open(request)?;
        let Some(node) = &self.cluster else {
            return Err(Status::failed_precondition(
                "this server is not in a cluster (it was started without --etcd)",
            ));
        };
        Ok(Response::new(convert::cluster_to_pb(node)))
    }

    async fn get_stats(&self, request: Request<pb::GetStatsRequest>) -> Result<Response<pb::Stats>, Status> {
        let (caller, r) = open(request)?;
        let tenant = match (r.tenant, caller.own_tenant()) {
            (Some(name), _) => Some(tenant(&caller, &name)?),
            (None, own) => own.cloned(),
        };
        let shm = self.regions.usage(tenant.as_ref());
        let stats = self
            .call(move |s| Ok(tenant.map_or_else(|| s.stats(), |t| s.tenant_stats(&t))))
            .await?;
        Ok(Response::new(convert::stats_to_pb(&stats, shm)))
    }

    async fn set_access_trace(
        &self,
        request: Request<pb::SetAccessTraceRequest>,
    ) -> Result<Response<pb::AccessTraceStatus>, Status> {
        let (caller, r) = open(request)?;
        caller.check_admin("SetAccessTrace")?;
        let status = match r.record {
            true => {
                let config = crate::access_trace::config(&r, &self.traces)?;
                Some(self.call(move |s| s.start_access_trace(config)).await?)
            }
            false => {
                crate::access_trace::check_stop(&r)?;
                self.call(|s| Ok(s.stop_access_trace())).await?
            }
        };
        Ok(Response::new(crate::access_trace::status_to_pb(status)))
    }
}
