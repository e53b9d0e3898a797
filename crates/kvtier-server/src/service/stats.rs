//! `GetStats`: the store's counters, the whole server's or one tenant's.

use kvtier_proto::v1 as pb;
use tonic::{Request, Response, Status};

use super::{KvTierService, open, tenant};
use crate::convert;

pub(super) async fn get_stats(
    svc: &KvTierService,
    request: Request<pb::GetStatsRequest>,
) -> Result<Response<pb::Stats>, Status> {
    let (caller, r) = open(request)?;
    let tenant = match (r.tenant, caller.own_tenant()) {
        (Some(name), _) => Some(tenant(&caller, &name)?),
        (None, own) => own.cloned(),
    };
    let shm = svc.regions.usage(tenant.as_ref());
    let stats = svc
        .call(move |s| Ok(tenant.map_or_else(|| s.stats(), |t| s.tenant_stats(&t))))
        .await?;
    Ok(Response::new(convert::stats_to_pb(&stats, shm)))
}
