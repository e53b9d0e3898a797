//! `LookupPrefix` and `GetCluster`: how much of a prefix this node holds,
//! and the cluster's membership as this node sees it.

use kvtier_proto::v1 as pb;
use tonic::{Request, Response, Status};

use super::{KvTierService, open, tenant};
use crate::convert;

pub(super) async fn lookup_prefix(
    svc: &KvTierService,
    request: Request<pb::LookupPrefixRequest>,
) -> Result<Response<pb::LookupPrefixResponse>, Status> {
    let (caller, r) = open(request)?;
    let tenant = tenant(&caller, &r.tenant)?;
    let layout = convert::layout(r.layout)?;
    let hashes = r.prefix_hashes.into_iter().map(|h| h.to_vec()).collect();
    let pages = svc.call(move |s| s.lookup_prefix(&tenant, layout, hashes)).await?;
    Ok(Response::new(pb::LookupPrefixResponse { pages }))
}

pub(super) async fn get_cluster(
    svc: &KvTierService,
    request: Request<pb::GetClusterRequest>,
) -> Result<Response<pb::ClusterView>, Status> {
    open(request)?;
    let Some(node) = &svc.cluster else {
        return Err(Status::failed_precondition(
            "this server is not in a cluster (it was started without --etcd)",
        ));
    };
    Ok(Response::new(convert::cluster_to_pb(node)))
}
