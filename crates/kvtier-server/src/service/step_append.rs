//! `SelectPagesRequest.append`: a decode step's own tokens, stored by the
//! call that selects for the step instead of by a second round trip. The
//! append is checked before the selection moves anything and made once the
//! selection's answer is ready, so the selection never includes it and an
//! answer that cannot be made appends nothing.

use kvtier_core::{SequenceKey, TenantId, wire};
use kvtier_proto::v1 as pb;
use kvtier_store::{AppendOutcome, AppendTokens, Store, StoreError, StoreResult};
use tonic::Status;

use super::write::append_to_pb;
use crate::convert;
use crate::moves::Access;

/// The append a selection carries, for the selection's layer and KV heads.
pub(crate) struct StepAppend {
    layer: u32,
    kv_head_start: u32,
    kv_head_count: u32,
    tokens: pb::AppendAfterSelection,
}

impl StepAppend {
    /// The request's append, taken out of it (the selection itself does not
    /// need its bytes).
    pub(crate) fn take(r: &mut pb::SelectPagesRequest) -> Option<Self> {
        r.append.take().map(|tokens| Self {
            layer: r.layer,
            kv_head_start: r.kv_head_start,
            kv_head_count: r.kv_head_count,
            tokens,
        })
    }

    fn request(&self) -> AppendTokens<'_> {
        AppendTokens {
            layer: self.layer,
            heads: convert::heads(self.kv_head_start, self.kv_head_count),
            num_tokens: self.tokens.num_tokens,
            kv: &self.tokens.kv,
            expected_position: self.tokens.position,
            persist: self.tokens.persist,
        }
    }

    /// Its K/V bytes' length.
    pub(crate) fn bytes(&self) -> usize {
        self.tokens.kv.len()
    }

    /// Its K/V rows, per KV head K rows then V rows (checked).
    pub(crate) fn kv(&self) -> &[u8] {
        &self.tokens.kv
    }

    /// Refuses now what the append would refuse, naming `append.*`.
    pub(crate) fn check(&self, store: &Store, key: &SequenceKey) -> StoreResult<()> {
        store.check_append(key, self.request()).map_err(named)
    }

    /// Appends, naming `append.*` in a refusal.
    pub(crate) fn run(&self, store: &Store, key: &SequenceKey) -> StoreResult<AppendOutcome> {
        store.append_tokens(key, self.request()).map_err(named)
    }
}

/// What a selection does to its sequence: one that appends writes it.
pub(crate) fn access(r: &pb::SelectPagesRequest) -> Access {
    match r.append {
        Some(_) => Access::Write,
        None => Access::Read,
    }
}

/// An answer at least as long, encoded, as any append's: what a selection
/// that appends holds room for in its first message.
pub(crate) fn largest_answer() -> pb::AppendTokensResponse {
    pb::AppendTokensResponse {
        tokens: u64::MAX,
        pages_opened: u64::MAX,
        durability: pb::Durability::Fsync as i32,
        timing: Some(pb::AppendTiming {
            lock_wait_us: u64::MAX,
            reserve_us: u64::MAX,
            migration_wait_us: u64::MAX,
            migration_us: u64::MAX,
            durability_us: u64::MAX,
            policy_us: u64::MAX,
            store_us: u64::MAX,
        }),
    }
}

/// Puts the append's outcome into the selection's first message; a refused
/// append gives back the lease the selection took (nothing else of it
/// stays: its swap-ins only moved pages between tiers).
pub(crate) fn answer(
    store: &Store,
    tenant: &TenantId,
    appended: Result<AppendOutcome, Status>,
    messages: &mut [pb::SelectPagesResponse],
) -> Result<(), Status> {
    let first = messages
        .first_mut()
        .expect("a selection answers with at least one message");
    match appended {
        Ok(outcome) => {
            first.appended = Some(append_to_pb(&outcome));
            Ok(())
        }
        Err(e) => {
            if first.lease_id != 0 {
                store.release_lease(tenant, first.lease_id);
            }
            Err(e)
        }
    }
}

/// An append's refusal as the selection's: its own fields under `append`.
fn named(mut e: StoreError) -> StoreError {
    if let StoreError::InvalidArgument(f) | StoreError::FailedPrecondition(f) = &mut e
        && let Some(field) = wire::in_selection_append(&f.field)
    {
        f.field = field.path.to_owned();
    }
    e
}
