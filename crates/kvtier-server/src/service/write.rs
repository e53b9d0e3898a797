//! `PutPages` and `AppendTokens`: each write located and converted, then
//! the store's write; a stream of puts answers with its weakest durability.

use kvtier_core::SequenceKey;
use kvtier_proto::v1 as pb;
use kvtier_store::{AppendOutcome, AppendTokens, PutPages, Store, StoreResult};
use tonic::{Request, Response, Status, Streaming};

use super::{KvTierService, open_seq};
use crate::auth::Caller;
use crate::convert;
use crate::moves::Access;
use crate::status::to_status;

pub(super) async fn put_pages(
    svc: &KvTierService,
    request: Request<Streaming<pb::PutPagesRequest>>,
) -> Result<Response<pb::PutPagesResponse>, Status> {
    let (caller, incarnation, mut stream) = open_seq(request)?;
    let mut total = pb::PutPagesResponse::default();
    let mut weakest: Option<pb::Durability> = None;
    while let Some(r) = stream.message().await? {
        let write = total.writes;
        let numbered = |e: Status| Status::new(e.code(), format!("write {write}: {}", e.message()));
        let (key, permit) = svc
            .located(&caller, &r.tenant, &r.sequence_id, incarnation, Access::Write)
            .await
            .map_err(numbered)?;
        let outcome = svc
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
        drop(permit);
        let d = convert::durability_to_pb(outcome.durability);
        weakest = Some(weakest.map_or(d, |w| w.min(d)));
        total.pages_written += outcome.pages_written;
        total.pages_shared += outcome.pages_shared;
        total.writes += 1;
    }
    total.durability = weakest.unwrap_or(pb::Durability::Memory) as i32;
    Ok(Response::new(total))
}

pub(super) async fn append_tokens(
    svc: &KvTierService,
    request: Request<pb::AppendTokensRequest>,
) -> Result<Response<pb::AppendTokensResponse>, Status> {
    let (caller, incarnation, r) = open_seq(request)?;
    let (key, _permit) = svc
        .located(&caller, &r.tenant, &r.sequence_id, incarnation, Access::Write)
        .await?;
    let outcome = svc.call(move |s| append(s, &key, &r)).await?;
    Ok(Response::new(append_to_pb(&outcome)))
}

pub(super) fn append_tokens_local(
    svc: &KvTierService,
    caller: &Caller,
    r: pb::AppendTokensRequest,
) -> Result<pb::AppendTokensResponse, Status> {
    let key = svc.key(caller, &r.tenant, &r.sequence_id)?;
    let _permit = svc.enter(&key, Access::Write)?;
    let outcome = append(&svc.store, &key, &r).map_err(to_status)?;
    Ok(append_to_pb(&outcome))
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

pub(super) fn append_to_pb(outcome: &AppendOutcome) -> pb::AppendTokensResponse {
    pb::AppendTokensResponse {
        tokens: outcome.tokens,
        pages_opened: outcome.pages_opened,
        durability: convert::durability_to_pb(outcome.durability) as i32,
        timing: Some(convert::append_timing_to_pb(&outcome.timing)),
    }
}
