//! `kvtier.v1.KvTier`, laid out by RPC: each file holds its RPCs' checks,
//! conversion, store call and response, and the service here only routes
//! (gRPC and the shm socket's local calls alike) and holds what every
//! handler shares: the caller, the sequence's key, where a sequence is in
//! a cluster, and the blocking call into the store.

mod cluster;
mod fetch;
mod moves;
mod policy;
mod select;
mod sequences;
mod stats;
mod step_append;
mod trace;
mod transition;
mod write;

use std::sync::Arc;

use kvtier_cluster::Node;
use kvtier_core::{Layout, SequenceKey, TenantId, wire};
use kvtier_proto::v1 as pb;
use kvtier_proto::v1::kv_tier_server::KvTier;
use kvtier_store::{Store, StoreResult};
use tonic::{Request, Response, Status, Streaming};

pub(crate) use trace::TraceSettings;

use crate::auth::Caller;
use crate::blocking::{blocking, may_wait};
use crate::convert;
use crate::inflight::InFlight;
use crate::moves::{Access, Mover, Permit};
use crate::shm::{LocalCalls, Regions};
use crate::status::{field_status, refused, to_status};
use fetch::FetchStream;
use select::SelectStream;

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
    /// Its sequences' moves to and from other nodes, in a cluster.
    moves: Option<Arc<Mover>>,
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
        moves: Option<Arc<Mover>>,
    ) -> Self {
        Self {
            store,
            max_message_bytes,
            in_flight,
            regions,
            traces: Arc::new(traces),
            cluster: moves.as_ref().map(|m| Arc::clone(&m.node)),
            moves,
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

    /// The sequence's key and, in a cluster, the call's permit against
    /// moves (held while the call runs); for a sequence this node does not
    /// hold, where it is instead (another node, a node that is out, lost),
    /// as the call's status. With the incarnation a call is meant for, a
    /// later creation of the id is refused (NOT_FOUND) rather than served.
    ///
    /// The caller's right to the tenant is checked first: a refusal must
    /// not tell a caller where another tenant's sequences are.
    async fn located(
        &self,
        caller: &Caller,
        tenant: &str,
        sequence_id: &str,
        incarnation: Option<u64>,
        access: Access,
    ) -> Result<(SequenceKey, Option<Permit>), Status> {
        let key = self.key(caller, tenant, sequence_id)?;
        let Some(node) = &self.cluster else {
            return Ok((key, None));
        };
        let permit = self.enter(&key, access)?;
        if !self.store.holds(&key) {
            node.whereabouts(&key, incarnation).await.map_err(refused)?;
        } else if let Some(expected) = incarnation {
            node.check_incarnation(&key, expected).map_err(refused)?;
        }
        Ok((key, permit))
    }

    /// In a cluster, the permit of a call for `key` against moves: waits
    /// (where waiting stalls no other task) while the sequence's move holds
    /// calls of its kind, and refuses one for a sequence that moved.
    fn enter(&self, key: &SequenceKey, access: Access) -> Result<Option<Permit>, Status> {
        let Some(moves) = &self.moves else { return Ok(None) };
        match moves.gate.try_enter(key, access).map_err(refused)? {
            Some(permit) => Ok(Some(permit)),
            None => may_wait(|| moves.gate.enter(key, access)).map(Some).map_err(refused),
        }
    }

    async fn call<T, F>(&self, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Arc<Store>) -> StoreResult<T> + Send + 'static,
    {
        blocking(Arc::clone(&self.store), f).await
    }

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
}

/// Calls over the shm socket: the gRPC calls' own checks and store calls,
/// run on the connection's thread (never a runtime worker, so an append
/// that migrates host pages to NVMe may take its time here).
impl LocalCalls for KvTierService {
    fn fetch_pages(&self, caller: &Caller, r: pb::FetchPagesRequest) -> Result<Vec<pb::FetchPagesResponse>, Status> {
        fetch::fetch_pages_local(self, caller, r)
    }

    fn select_pages(&self, caller: &Caller, r: pb::SelectPagesRequest) -> Result<Vec<pb::SelectPagesResponse>, Status> {
        select::select_pages_local(self, caller, r)
    }

    fn append_tokens(&self, caller: &Caller, r: pb::AppendTokensRequest) -> Result<pb::AppendTokensResponse, Status> {
        write::append_tokens_local(self, caller, r)
    }

    fn warm_after(&self, caller: &Caller, r: &pb::SelectPagesRequest) {
        select::warm_after(self, caller, r);
    }
}

/// Each RPC in its own file: its checks, its store call, its response.
#[tonic::async_trait]
impl KvTier for KvTierService {
    async fn create_sequence(
        &self,
        request: Request<pb::CreateSequenceRequest>,
    ) -> Result<Response<pb::CreateSequenceResponse>, Status> {
        sequences::create_sequence(self, request).await
    }

    async fn get_sequence(
        &self,
        request: Request<pb::GetSequenceRequest>,
    ) -> Result<Response<pb::SequenceInfo>, Status> {
        sequences::get_sequence(self, request).await
    }

    async fn drop_sequence(
        &self,
        request: Request<pb::DropSequenceRequest>,
    ) -> Result<Response<pb::DropSequenceResponse>, Status> {
        sequences::drop_sequence(self, request).await
    }

    async fn put_pages(
        &self,
        request: Request<Streaming<pb::PutPagesRequest>>,
    ) -> Result<Response<pb::PutPagesResponse>, Status> {
        write::put_pages(self, request).await
    }

    async fn append_tokens(
        &self,
        request: Request<pb::AppendTokensRequest>,
    ) -> Result<Response<pb::AppendTokensResponse>, Status> {
        write::append_tokens(self, request).await
    }

    type FetchPagesStream = FetchStream;

    async fn fetch_pages(&self, request: Request<pb::FetchPagesRequest>) -> Result<Response<FetchStream>, Status> {
        fetch::fetch_pages(self, request).await
    }

    type SelectPagesStream = SelectStream;

    async fn select_pages(&self, request: Request<pb::SelectPagesRequest>) -> Result<Response<SelectStream>, Status> {
        select::select_pages(self, request).await
    }

    async fn prefetch(
        &self,
        request: Request<pb::SelectPagesRequest>,
    ) -> Result<Response<pb::PrefetchResponse>, Status> {
        select::prefetch(self, request).await
    }

    async fn release_lease(
        &self,
        request: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        select::release_lease(self, request).await
    }

    async fn set_page_state(
        &self,
        request: Request<pb::SetPageStateRequest>,
    ) -> Result<Response<pb::SetPageStateResponse>, Status> {
        transition::set_page_state(self, request).await
    }

    async fn apply_policy(
        &self,
        request: Request<pb::ApplyPolicyRequest>,
    ) -> Result<Response<pb::ApplyPolicyResponse>, Status> {
        policy::apply_policy(self, request).await
    }

    async fn report_attention(
        &self,
        request: Request<pb::ReportAttentionRequest>,
    ) -> Result<Response<pb::ReportAttentionResponse>, Status> {
        policy::report_attention(self, request).await
    }

    async fn lookup_prefix(
        &self,
        request: Request<pb::LookupPrefixRequest>,
    ) -> Result<Response<pb::LookupPrefixResponse>, Status> {
        cluster::lookup_prefix(self, request).await
    }

    async fn get_cluster(&self, request: Request<pb::GetClusterRequest>) -> Result<Response<pb::ClusterView>, Status> {
        cluster::get_cluster(self, request).await
    }

    type DrainNodeStream = moves::DrainStream;

    async fn drain_node(
        &self,
        request: Request<pb::DrainNodeRequest>,
    ) -> Result<Response<Self::DrainNodeStream>, Status> {
        moves::drain_node(self, request).await
    }

    type MoveSequenceStream = crate::moves::MoveStream;

    async fn move_sequence(
        &self,
        request: Request<Streaming<pb::MoveSequenceRequest>>,
    ) -> Result<Response<Self::MoveSequenceStream>, Status> {
        moves::move_sequence(self, request).await
    }

    async fn get_stats(&self, request: Request<pb::GetStatsRequest>) -> Result<Response<pb::Stats>, Status> {
        stats::get_stats(self, request).await
    }

    async fn set_access_trace(
        &self,
        request: Request<pb::SetAccessTraceRequest>,
    ) -> Result<Response<pb::AccessTraceStatus>, Status> {
        trace::set_access_trace(self, request).await
    }
}
