//! `SetPageState`: an explicit transition of a range or list of pages.

use kvtier_core::{Reason, wire};
use kvtier_proto::v1 as pb;
use kvtier_store::{PageSelection, SetPageState};
use tonic::{Request, Response, Status};

use super::{KvTierService, open_seq};
use crate::convert;
use crate::moves::Access;
use crate::status::invalid;

pub(super) async fn set_page_state(
    svc: &KvTierService,
    request: Request<pb::SetPageStateRequest>,
) -> Result<Response<pb::SetPageStateResponse>, Status> {
    let (caller, incarnation, r) = open_seq(request)?;
    let (key, _permit) = svc
        .located(&caller, &r.tenant, &r.sequence_id, incarnation, Access::Write)
        .await?;
    let (action, summary_rows) = convert::action(r.action)?;
    if !r.pages.is_empty() && (r.first_page != 0 || r.page_count != 0) {
        return Err(invalid(
            wire::PAGES,
            "give either pages or first_page/page_count, not both",
        ));
    }
    let outcome = svc
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
