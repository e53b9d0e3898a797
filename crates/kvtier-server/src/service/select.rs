//! `SelectPages`, `Prefetch` and `ReleaseLease`: a selection checked and
//! sized before it moves anything, run with its data read inline or into
//! the caller's shm window, then as messages within the message limit (a
//! lease it took given back if they cannot be made).

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use kvtier_core::rank::Ranking;
use kvtier_core::select::{Aggregation, Budget, Shard};
use kvtier_core::{Layout, SequenceKey, TenantId, wire};
use kvtier_proto::v1 as pb;
use kvtier_store::{SelectPages, Selection, Store, StoreError, StoreResult};
use prost::Message;
use tonic::{Request, Response, Status};

use super::step_append::{self, StepAppend};
use super::{KvTierService, open, open_seq, tenant};
use crate::auth::Caller;
use crate::blocking::sized;
use crate::inflight::Holding;
use crate::moves::Access;
use crate::responses::{Held_, PIPELINED_BYTES, holding, inline_pages, read_to_bytes};
use crate::shm::Window;
use crate::status::{invalid, to_status};
use crate::{chunk, convert};

pub(crate) type SelectStream = Holding<tokio_stream::Iter<std::vec::IntoIter<Held_<pb::SelectPagesResponse>>>>;

pub(super) async fn select_pages(
    svc: &KvTierService,
    request: Request<pb::SelectPagesRequest>,
) -> Result<Response<SelectStream>, Status> {
    let start = Instant::now();
    let (caller, incarnation, r) = open_seq(request)?;
    let (_, _permit) = svc
        .located(&caller, &r.tenant, &r.sequence_id, incarnation, step_append::access(&r))
        .await?;
    let call = svc.plan_select(&caller, r)?;
    // The data's room in flight, at most what the selection can choose,
    // is taken before the store reads any of it; an attending selection's
    // buffer likewise. Data over shm goes to the client's memory: nothing
    // held in flight.
    let held = match call.data_inline() || call.request.attend {
        true => Some(svc.in_flight.hold("a selection's data", call.room()).await?),
        false => None,
    };
    let (key, limit, work) = (call.key.clone(), call.limit, call.work());
    let (selection, data, append) = sized(&svc.store, &key, work, move |s| call.run(s)).await?;
    let mut messages = svc.selection_messages(&key.tenant, selection, data, limit, append.is_some())?;
    if let Some(append) = append {
        // Where the selection ran: inline unless it is large or may wait.
        let k = key.clone();
        let appended = sized(&svc.store, &key, append.bytes(), move |s| append.run(s, &k)).await;
        step_append::answer(&svc.store, &key.tenant, appended, &mut messages)?;
    }
    stamp_server_time(&mut messages, start);
    Ok(Response::new(Holding::new(tokio_stream::iter(holding(messages, held)))))
}

pub(super) fn select_pages_local(
    svc: &KvTierService,
    caller: &Caller,
    r: pb::SelectPagesRequest,
) -> Result<Vec<pb::SelectPagesResponse>, Status> {
    let start = Instant::now();
    let access = step_append::access(&r);
    let call = svc.plan_select(caller, r)?;
    let _permit = svc.enter(&call.key, access)?;
    if call.data_inline() {
        return Err(invalid(
            wire::SHM,
            "is required with include_data over the shm socket, which carries no page bytes",
        ));
    }
    let (key, limit) = (call.key.clone(), call.limit);
    let (selection, data, append) = call.run(&svc.store).map_err(to_status)?;
    let mut messages = svc.selection_messages(&key.tenant, selection, data, limit, append.is_some())?;
    if let Some(a) = append {
        let appended = a.run(&svc.store, &key).map_err(to_status);
        step_append::answer(&svc.store, &key.tenant, appended, &mut messages)?;
    }
    stamp_server_time(&mut messages, start);
    Ok(messages)
}

/// Puts the server's time for a selection since `start` in its first
/// message, which [`select_messages`] sized with room for any.
fn stamp_server_time(messages: &mut [pb::SelectPagesResponse], start: Instant) {
    if let Some(timing) = messages.first_mut().and_then(|m| m.timing.as_mut()) {
        timing.server_us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
    }
}

/// After selection `r` answered over a region: the next layer's index and
/// pages' places warmed on this thread, where a decode loop's next call
/// comes (`Store::warm_next_layer`).
pub(super) fn warm_after(svc: &KvTierService, caller: &Caller, r: &pb::SelectPagesRequest) {
    if let Ok(key) = svc.key(caller, &r.tenant, &r.sequence_id) {
        let heads = convert::heads(r.kv_head_start, r.kv_head_count);
        svc.store.warm_next_layer(&key, r.layer, heads);
    }
}

pub(super) async fn prefetch(
    svc: &KvTierService,
    request: Request<pb::SelectPagesRequest>,
) -> Result<Response<pb::PrefetchResponse>, Status> {
    let (caller, incarnation, r) = open_seq(request)?;
    let (key, _permit) = svc
        .located(&caller, &r.tenant, &r.sequence_id, incarnation, Access::Read)
        .await?;
    for (set, field) in [
        (r.include_data, wire::INCLUDE_DATA.path),
        (r.swap_in, wire::SWAP_IN.path),
        (r.deadline_us > 0, wire::DEADLINE_US.path),
        (r.lease_ms > 0, wire::LEASE_MS.path),
        (r.append.is_some(), wire::SELECTION_APPEND.path),
        (r.gather_heads, wire::GATHER_HEADS.path),
        (r.attend, wire::ATTEND.path),
    ] {
        if set {
            return Err(invalid(
                field,
                "must be unset for Prefetch, which only schedules promotions",
            ));
        }
    }
    let inputs = selection_inputs(&r)?;
    let pages_queued = svc
        .call(move |s| s.prefetch_query(&key, select_request(&r, &inputs)))
        .await?;
    Ok(Response::new(pb::PrefetchResponse { pages_queued }))
}

pub(super) async fn release_lease(
    svc: &KvTierService,
    request: Request<pb::ReleaseLeaseRequest>,
) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
    let (caller, r) = open(request)?;
    let tenant = tenant(&caller, &r.tenant)?;
    let id = r.lease_id;
    if svc.call(move |s| Ok(s.release_lease(&tenant, id))).await? {
        Ok(Response::new(pb::ReleaseLeaseResponse {}))
    } else {
        Err(to_status(StoreError::NotFound {
            what: format!("lease {id}"),
        }))
    }
}

/// The parts of a selection request that need converting.
struct SelectionInputs {
    queries: Vec<f32>,
    /// `None`: the mode's own.
    aggregation: Option<Aggregation>,
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

/// A selection run: its choice, its pages' messages apart, and the append
/// still to make.
type Ran = (Selection<Range<usize>>, Vec<pb::Page>, Option<StepAppend>);

/// A selection, checked and ready to run: refused before it moves
/// anything.
pub(crate) struct SelectCall {
    key: SequenceKey,
    request: pb::SelectPagesRequest,
    /// Its append, made once the answer is ready.
    append: Option<StepAppend>,
    inputs: SelectionInputs,
    window: Option<Window>,
    /// The most page bytes it can return.
    bound: usize,
    /// With `attend`: the most bytes the store's buffer holds.
    attend_room: usize,
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

    /// Bytes it reads pages into: the answer, the window, or (attending)
    /// the store's own buffer, with the rows widened to f32.
    fn room(&self) -> usize {
        match (self.request.include_data, self.request.attend) {
            (true, _) => self.bound,
            (false, true) => self.attend_room,
            (false, false) => 0,
        }
    }

    /// The selection, its append checked first; the append is handed
    /// back, to be made once the answer is.
    fn run(mut self, store: &Arc<Store>) -> StoreResult<Ran> {
        let append = self.append.take();
        if let Some(a) = &append {
            a.check(store, &self.key)?;
        }
        let req = select_request(&self.request, &self.inputs);
        if self.request.attend {
            // The step's own tokens are attended too, after the chosen
            // pages: the answer is then the step's whole attention.
            let own = append.as_ref().map(StepAppend::kv);
            return Ok((store.select_attending(&self.key, req, own)?, Vec::new(), append));
        }
        let room = self.room();
        let gather_heads = self.request.gather_heads;
        let (selection, data) = select_into(store, &self.key, req, self.window.as_mut(), gather_heads, room)?;
        Ok((selection, data, append))
    }
}

impl KvTierService {
    /// A selection, checked, with its shm window if it names one.
    fn plan_select(&self, caller: &Caller, mut r: pb::SelectPagesRequest) -> Result<SelectCall, Status> {
        let key = self.key(caller, &r.tenant, &r.sequence_id)?;
        let limit = chunk::limit(r.max_chunk_bytes, self.max_message_bytes)?;
        let inputs = selection_inputs(&r)?;
        let shm = r.shm.take();
        let append = StepAppend::take(&mut r);
        if append.is_some() && r.shard.is_some() {
            // Every rank would append the same token.
            return Err(invalid(
                wire::SELECTION_APPEND,
                "a context-parallel rank's selection (shard) appends nothing: append from one rank with \
                 AppendTokens, or with an unsharded selection",
            ));
        }
        if r.attend {
            for (set, field) in [
                (r.include_data, wire::INCLUDE_DATA),
                (shm.is_some(), wire::SHM),
                (r.gather_heads, wire::GATHER_HEADS),
            ] {
                if set {
                    return Err(invalid(
                        field,
                        "must be unset with attend, whose answer is each query head's attention, not the pages",
                    ));
                }
            }
        }
        if shm.is_some() && !r.include_data {
            return Err(invalid(wire::SHM, "carries page bytes; set include_data too"));
        }
        if r.gather_heads && shm.is_none() {
            return Err(invalid(
                wire::GATHER_HEADS,
                "lays out the pages written into a shared-memory window; set shm (and include_data) too",
            ));
        }
        let shape = self.shape(&key)?;
        if r.attend {
            // Heads past the layout's are refused by the store, by name.
            let kv_heads = r.kv_head_count.min(shape.0.num_kv_heads());
            let query_heads = kv_heads as usize * shape.0.group_size() as usize;
            let pages = u64::from(r.budget_pages).min(shape.1.div_ceil(u64::from(shape.0.page_size())));
            let pages = usize::try_from(pages).unwrap_or(usize::MAX);
            chunk::check_attention_fits(query_heads, shape.0.head_dim() as usize, pages, limit)?;
        }
        let scanned = index_scanned(r.kv_head_count, r.budget_pages, &inputs.ranking, &shape);
        let bound = kvtier_store::data_bound(
            &shape.0,
            shape.1,
            r.budget_pages,
            r.kv_head_count,
            select_request(&r, &inputs).aggregation(),
        );
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
            append,
            inputs,
            window,
            bound,
            attend_room: kvtier_store::attend_room(&shape.0, bound),
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
        appends: bool,
    ) -> Result<Vec<pb::SelectPagesResponse>, Status> {
        let lease = selection.lease;
        let messages = select_messages(selection, data, limit, appends);
        if let (Err(_), Some((id, _))) = (&messages, lease) {
            self.store.release_lease(tenant, id);
        }
        messages
    }
}

/// The digest bytes a selection of `kv_heads` heads scans: every page's
/// min and max rows.
pub(crate) fn index_scanned(
    kv_heads: u32,
    budget_pages: u32,
    ranking: &Ranking,
    (layout, tokens): &(Arc<Layout>, u64),
) -> usize {
    let heads = kv_heads.min(layout.num_kv_heads()) as usize;
    kvtier_store::index_scan_bytes(layout, *tokens, budget_pages as usize, ranking).saturating_mul(heads)
}

/// A selection with its data read straight into `window`, or into a new
/// buffer of `room` bytes when there is none; the pages' messages apart.
/// With `gather_heads`, the window gets each KV head's K rows then its V
/// rows, read there as such.
pub(crate) fn select_into(
    store: &Arc<Store>,
    key: &SequenceKey,
    req: SelectPages<'_>,
    window: Option<&mut Window>,
    gather_heads: bool,
    room: usize,
) -> StoreResult<(Selection<Range<usize>>, Vec<pb::Page>)> {
    Ok(match window {
        Some(w) if gather_heads => {
            let mut buf = w.per_head_buf();
            let mut selection = store.select_pages_into(key, req, &mut buf)?;
            let data = std::mem::take(&mut selection.data);
            let halves = data.into_iter().map(|p| p.map(|r| buf.halves(&r))).collect();
            (selection, w.gathered_pages(halves))
        }
        Some(w) => {
            let mut selection = store.select_pages_into(key, req, &mut w.buf())?;
            let pages = w.pages(std::mem::take(&mut selection.data));
            (selection, pages)
        }
        None => {
            let (mut selection, bytes) = read_to_bytes(room, |buf| store.select_pages_into(key, req, buf))?;
            let pages = inline_pages(std::mem::take(&mut selection.data), &bytes);
            (selection, pages)
        }
    })
}

/// A selection as response messages within `limit`: the totals with as
/// many heads as fit, the remaining heads, then the pages.
pub(crate) fn select_messages<B>(
    selection: Selection<B>,
    data: Vec<pb::Page>,
    limit: usize,
    appends: bool,
) -> Result<Vec<pb::SelectPagesResponse>, Status> {
    let first = pb::SelectPagesResponse {
        heads: vec![],
        pages_scored: selection.pages_scored,
        digest_bytes: selection.digest_bytes,
        lanes_reused: selection.lanes_reused,
        pages: vec![],
        swap: Some(convert::swap_to_pb(&selection.swap)),
        prefetch_queued: selection.prefetch_queued,
        lease_id: selection.lease.map_or(0, |(id, _)| id),
        lease_expires_in_ms: selection.lease.map_or(0, |(_, at)| {
            at.saturating_duration_since(std::time::Instant::now()).as_millis() as u64
        }),
        // Sized with room for the server's time, stamped once the answer is made.
        timing: Some(pb::SelectTiming {
            server_us: u64::MAX,
            ..convert::timing_to_pb(&selection.timing)
        }),
        mode: convert::mode_to_pb(selection.mode) as i32,
        // Sized with room for the append's answer, which replaces it.
        appended: appends.then(step_append::largest_answer),
        attention: selection.attention.iter().map(convert::attention_to_pb).collect(),
    };
    let heads = selection.heads.iter().map(convert::head_selection_to_pb).collect();
    let mut head_runs = chunk::fit(heads, first.encoded_len(), limit, "KV head's selection")?.into_iter();
    // Pages in messages of the same size as an inline fetch's chunks, so
    // that the client receives one while the server encodes the next.
    let data = chunk::fit_within(data, 0, PIPELINED_BYTES, limit, "page")?;
    let first = pb::SelectPagesResponse {
        heads: head_runs.next().unwrap_or_default(),
        ..first
    };
    let more_heads = head_runs.map(|heads| pb::SelectPagesResponse {
        heads,
        ..Default::default()
    });
    let pages = data.into_iter().map(|pages| pb::SelectPagesResponse {
        pages,
        ..Default::default()
    });
    Ok(std::iter::once(first).chain(more_heads).chain(pages).collect())
}

#[cfg(test)]
mod tests {
    use kvtier_core::PageState;
    use kvtier_core::rank::Mode;
    use kvtier_store::{HeadSelection, SelectTiming, SelectedPage, SwapReport};
    use prost::Message;

    use super::*;

    fn selection(heads: u32, pages: u32) -> Selection<Range<usize>> {
        Selection {
            heads: (0..heads)
                .map(|kv_head| HeadSelection {
                    kv_head,
                    query_head: None,
                    pages: (0..pages)
                        .map(|page| SelectedPage {
                            page,
                            bound: page as f32 / 3.0,
                            state: PageState::Hot,
                            miss: None,
                        })
                        .collect(),
                    selected_but_gone: 0,
                })
                .collect(),
            data: vec![],
            pages_scored: u64::from(heads * pages),
            digest_bytes: 1 << 20,
            lanes_reused: 0,
            swap: SwapReport::default(),
            past_deadline: false,
            prefetch_queued: 0,
            lease: None,
            timing: SelectTiming::default(),
            mode: Mode::TwoStage,
            attention: vec![],
        }
    }

    /// Whatever the limit, a selection that appends leaves room in its
    /// first message for any append's answer, put in after the cut.
    #[test]
    fn the_first_message_holds_room_for_the_appends_answer() {
        let mut cut = 0;
        for limit in 100..2000 {
            let Ok(mut messages) = select_messages(selection(24, 9), vec![], limit, true) else {
                continue;
            };
            messages[0].appended = Some(step_append::largest_answer());
            for m in &messages {
                assert!(
                    m.encoded_len() <= limit,
                    "{} bytes over a limit of {limit}",
                    m.encoded_len()
                );
            }
            cut += 1;
        }
        assert!(cut > 1000, "most limits hold a head");
    }
}
