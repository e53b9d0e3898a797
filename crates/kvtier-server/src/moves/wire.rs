//! A moved page between the store's [`ExportedPage`] and the wire's
//! `MovedPage`; every refusal names the field.

use kvtier_core::{Reason, wire};
use kvtier_proto::v1 as pb;
use kvtier_store::{ExportedPage, MovedContent};
use tonic::Status;

use crate::convert;
use crate::status::invalid;

pub(crate) fn page_to_pb(page: ExportedPage) -> pb::MovedPage {
    let rows = page.rows;
    match page.content {
        // Hot or cold alike: the receiver places the page by its own tiers.
        MovedContent::Original(kv) => pb::MovedPage {
            state: pb::PageState::Cold as i32,
            tokens: rows,
            kv: kv.into(),
            durable: page.durable,
            ..pb::MovedPage::default()
        },
        MovedContent::Summary {
            counts,
            kv,
            reason,
            index_entry,
        } => pb::MovedPage {
            state: pb::PageState::Summary as i32,
            tokens: rows,
            kv: kv.into(),
            summary_counts: counts,
            reason: convert::reason_to_pb(reason) as i32,
            index_entry: index_entry.into(),
            durable: false,
        },
        MovedContent::Gone { reason, index_entry } => pb::MovedPage {
            state: pb::PageState::Gone as i32,
            tokens: rows,
            reason: convert::reason_to_pb(reason) as i32,
            index_entry: index_entry.into(),
            ..pb::MovedPage::default()
        },
    }
}

/// Page `at` of a `MovedLane`.
pub(crate) fn page_from_pb(at: usize, p: pb::MovedPage) -> Result<ExportedPage, Status> {
    let state = pb::PageState::try_from(p.state).unwrap_or(pb::PageState::Unspecified);
    let content = match state {
        pb::PageState::Hot | pb::PageState::Cold => MovedContent::Original(p.kv.to_vec()),
        pb::PageState::Summary => MovedContent::Summary {
            counts: p.summary_counts,
            kv: p.kv.to_vec(),
            reason: reason(at, p.reason)?,
            index_entry: p.index_entry.to_vec(),
        },
        pb::PageState::Gone => MovedContent::Gone {
            reason: reason(at, p.reason)?,
            index_entry: p.index_entry.to_vec(),
        },
        pb::PageState::Unspecified => {
            return Err(invalid(
                wire::moved_page(at, wire::MOVED_PAGE_STATE),
                format!("{} is not one of PAGE_STATE_HOT, _COLD, _SUMMARY, _GONE", p.state),
            ));
        }
    };
    let durable = p.durable && matches!(content, MovedContent::Original(_));
    Ok(ExportedPage {
        rows: p.tokens,
        content,
        durable,
    })
}

fn reason(at: usize, value: i32) -> Result<Reason, Status> {
    let field = wire::moved_page(at, wire::MOVED_PAGE_REASON);
    match pb::Reason::try_from(value) {
        Ok(pb::Reason::Explicit) => Ok(Reason::Explicit),
        Ok(pb::Reason::Capacity) => Ok(Reason::CapacityPressure),
        Ok(pb::Reason::Demand) => Ok(Reason::Demand),
        Ok(pb::Reason::Prefetch) => Ok(Reason::Prefetch),
        Ok(pb::Reason::Policy) => Ok(Reason::Policy),
        Ok(pb::Reason::Integrity) => Ok(Reason::Integrity),
        Ok(pb::Reason::LostOnRestart) => Ok(Reason::LostOnRestart),
        Ok(pb::Reason::Unspecified) | Err(_) => Err(invalid(field, format!("{value} is not a reason"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_page_kind_round_trips_and_an_unknown_state_is_named() {
        for content in [
            MovedContent::Original(vec![1, 2, 3, 4]),
            MovedContent::Summary {
                counts: vec![3, 1],
                kv: vec![5; 8],
                reason: Reason::Policy,
                index_entry: vec![9; 6],
            },
            MovedContent::Gone {
                reason: Reason::LostOnRestart,
                index_entry: vec![7; 6],
            },
        ] {
            let durable = matches!(content, MovedContent::Original(_));
            let page = ExportedPage {
                rows: 4,
                content,
                durable,
            };
            assert_eq!(page_from_pb(0, page_to_pb(page.clone())).unwrap(), page);
        }
        let e = page_from_pb(3, pb::MovedPage::default()).unwrap_err();
        assert!(e.message().starts_with("lane.pages[3].state"), "{}", e.message());
        let gone = pb::MovedPage {
            state: pb::PageState::Gone as i32,
            ..pb::MovedPage::default()
        };
        let e = page_from_pb(1, gone).unwrap_err();
        assert!(e.message().starts_with("lane.pages[1].reason"), "{}", e.message());
    }
}
