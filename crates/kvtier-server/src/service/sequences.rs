//! `CreateSequence`, `GetSequence` and `DropSequence`; in a cluster a
//! create claims the sequence's ownership record first (and gives it back
//! if the create fails), a drop releases it.

use kvtier_cluster::placement;
use kvtier_proto::v1 as pb;
use tonic::{Request, Response, Status};

use super::{KvTierService, open, open_seq};
use crate::convert;
use crate::moves::Access;
use crate::status::refused;

pub(super) async fn create_sequence(
    svc: &KvTierService,
    request: Request<pb::CreateSequenceRequest>,
) -> Result<Response<pb::CreateSequenceResponse>, Status> {
    let (caller, r) = open(request)?;
    let key = svc.key(&caller, &r.tenant, &r.sequence_id)?;
    let layout = convert::layout(r.layout)?;
    let hashes: Vec<Vec<u8>> = r.prefix_hashes.into_iter().map(|h| h.to_vec()).collect();
    let group = convert::group(r.group)?;
    let incarnation = match &svc.cluster {
        Some(node) => {
            let placement = placement(key.tenant.as_str(), key.sequence.as_str(), &hashes, group.as_ref());
            let claimed = node.claim(&key, placement, group.clone()).await.map_err(refused)?;
            if let Some(moves) = &svc.moves {
                // A marker of an earlier creation that moved away answers
                // no more: this one is here.
                moves.gate.end_moved(&key);
            }
            claimed
        }
        None => 0,
    };
    let claimed = key.clone();
    let created = svc.call(move |s| s.create_sequence(key, layout, hashes)).await;
    let created = match (created, &svc.cluster) {
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

pub(super) async fn get_sequence(
    svc: &KvTierService,
    request: Request<pb::GetSequenceRequest>,
) -> Result<Response<pb::SequenceInfo>, Status> {
    let (caller, incarnation, r) = open_seq(request)?;
    let (key, _permit) = svc
        .located(&caller, &r.tenant, &r.sequence_id, incarnation, Access::Read)
        .await?;
    let incarnation = svc.cluster.as_ref().and_then(|n| n.incarnation(&key)).unwrap_or(0);
    let info = svc.call(move |s| s.sequence_info(&key)).await?;
    Ok(Response::new(pb::SequenceInfo {
        incarnation,
        ..convert::info_to_pb(&info)
    }))
}

pub(super) async fn drop_sequence(
    svc: &KvTierService,
    request: Request<pb::DropSequenceRequest>,
) -> Result<Response<pb::DropSequenceResponse>, Status> {
    let (caller, incarnation, r) = open_seq(request)?;
    let (key, permit) = svc
        .located(&caller, &r.tenant, &r.sequence_id, incarnation, Access::Write)
        .await?;
    let dropped = key.clone();
    svc.call(move |s| s.drop_sequence(&key)).await?;
    drop(permit);
    if let Some(node) = &svc.cluster
        && let Err(e) = node.release(&dropped).await
    {
        // The record names this node and a sequence it no longer
        // holds: a later create here reclaims it, a read gets NOT_FOUND.
        tracing::warn!(error = %e, "could not release the ownership record of a dropped sequence");
    }
    Ok(Response::new(pb::DropSequenceResponse {}))
}
