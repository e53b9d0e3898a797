//! An independent model of what a kvtier server must serve: for every
//! sequence and lane, the rows written, the rows acknowledged durable, and
//! each page's fate (original bytes, summary, gone with a reason), with the
//! bytes of every position computable from its name alone.
//!
//! After a crash the model does not know what the server had not made
//! durable yet; it checks what must hold (acknowledged rows present, no
//! byte where it was not written, acknowledged reasons kept) and then
//! adopts what it read. Without a crash everything must match exactly.

use std::collections::BTreeMap;
use std::ops::Range;

use kvtier_client::{Client, ClientError, pb};

pub const LAYERS: u32 = 2;
pub const HEADS: u32 = 2;
pub const DIM: usize = 4;
pub const PAGE: u64 = 4;
/// Pages of a shared prompt, when a sequence has one.
pub const PREFIX_PAGES: u64 = 2;
const LANES: usize = (LAYERS * HEADS) as usize;

/// f16, 2 layers × 2 KV heads, head_dim 4, 4-token pages: small pages, so
/// that a few writes make many of them.
pub fn layout() -> pb::Layout {
    kvtier_client::layout(LAYERS, HEADS, HEADS, DIM as u32, pb::DType::DtypeF16, PAGE as u32)
}

/// A sequence name: `s{name}` in tenant `t{tenant}`. The same names exist in
/// both tenants, as different sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId {
    pub tenant: u8,
    pub name: u8,
}

impl SeqId {
    pub fn tenant(&self) -> String {
        format!("t{}", self.tenant)
    }
    pub fn name(&self) -> String {
        format!("s{}", self.name)
    }
}

/// The prefix hashes of shared prompt `doc`: the same strings in every
/// tenant (sharing must still stay within a tenant).
pub fn prefix_hashes(doc: u8) -> Vec<bytes::Bytes> {
    (0..PREFIX_PAGES)
        .map(|p| bytes::Bytes::from(format!("doc{doc}-page{p}")))
        .collect()
}

/// One SplitMix64 step: the golden-ratio increment, then the mixer.
fn mix(x: u64) -> u64 {
    kvtier_core::hash::mix64(x.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// What a page is, as far as the model knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Bytes,
    Summary,
    Gone(pb::Reason),
    /// A change whose acknowledgement a crash cut off: it may or may not
    /// have happened.
    MaybeSummary,
    MaybeGone(pb::Reason),
    /// A summary that an eviction cut off by a crash may have removed.
    SummaryMaybeGone(pb::Reason),
}

#[derive(Debug, Clone, Default)]
pub struct LaneModel {
    /// Rows certainly present (until a crash).
    pub rows: u64,
    /// Rows that may be present (a write cut off by a crash).
    pub attempted: u64,
    /// Rows acknowledged durable.
    pub durable: u64,
    /// One per page of `attempted`.
    pub fates: Vec<Fate>,
}

impl LaneModel {
    fn extend_to(&mut self, rows: u64) {
        self.attempted = self.attempted.max(rows);
        self.fates.resize(self.attempted.div_ceil(PAGE) as usize, Fate::Bytes);
    }
}

#[derive(Debug, Clone)]
pub struct SeqModel {
    pub incarnation: u32,
    pub prefix: Option<u8>,
    /// The operation that created it.
    pub created: u64,
    pub lanes: Vec<LaneModel>,
}

impl SeqModel {
    pub fn lane(layer: u32, head: u32) -> usize {
        (layer * HEADS + head) as usize
    }

    /// Rows of each head of `heads` in `layer`.
    pub fn rows(&self, layer: u32, heads: Range<u32>) -> Vec<u64> {
        heads.map(|h| self.lanes[Self::lane(layer, h)].rows).collect()
    }
}

/// What a check found wrong, by kind, and what it saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    /// Rows acknowledged durable that did not come back.
    pub durable_rows_lost: u64,
    /// Pages served with bytes other than those written at their position.
    pub wrong_bytes: u64,
    /// Pages whose acknowledged fate (gone with a reason, summary) changed.
    pub fate_changed: u64,
    /// Anything else the model rules out (sequences missing, lengths
    /// beyond what was written, counts that disagree).
    pub other: u64,
    /// The first violations, described.
    pub messages: Vec<String>,
    /// Pages read, by observed state (and gone reason).
    pub pages_by_state: BTreeMap<String, u64>,
}

impl Findings {
    pub fn violations(&self) -> u64 {
        self.durable_rows_lost + self.wrong_bytes + self.fate_changed + self.other
    }

    fn note(&mut self, message: String) {
        if self.messages.len() < 20 {
            self.messages.push(message);
        }
    }

    /// Anything else the model rules out, described.
    pub fn violation(&mut self, message: String) {
        self.other += 1;
        self.note(message);
    }

    pub fn merge(&mut self, other: Findings) {
        self.durable_rows_lost += other.durable_rows_lost;
        self.wrong_bytes += other.wrong_bytes;
        self.fate_changed += other.fate_changed;
        self.other += other.other;
        for m in other.messages {
            self.note(m);
        }
        for (k, v) in other.pages_by_state {
            *self.pages_by_state.entry(k).or_default() += v;
        }
    }
}

/// The whole model.
#[derive(Debug, Clone, Default)]
pub struct Model {
    pub seqs: BTreeMap<SeqId, SeqModel>,
    incarnations: BTreeMap<SeqId, u32>,
    /// Operations acknowledged so far.
    op: u64,
    /// The last acknowledged operation that committed the manifest (a
    /// persist, a transition, a policy, a drop): everything journalled
    /// before it is on disk.
    committed: u64,
    /// NVMe blocks corrupted on purpose so far.
    pub corruptions: u32,
    /// Persisting writes acknowledged.
    pub durable_writes: u64,
    /// Everything every check found.
    pub findings: Findings,
}

impl Model {
    /// Bytes of one row (K, or V with `value`) at `pos` of `lane`.
    pub fn row(&self, id: SeqId, seq: &SeqModel, lane: usize, pos: u64, value: bool) -> Vec<u8> {
        let source = match seq.prefix {
            Some(doc) if pos < PREFIX_PAGES * PAGE => 1 << 40 | u64::from(doc),
            _ => u64::from(id.name) << 32 | u64::from(seq.incarnation),
        };
        let base = mix(mix(u64::from(id.tenant)) ^ source) ^ mix(lane as u64) ^ mix(pos << 1 | u64::from(value));
        (0..DIM as u64)
            .flat_map(|i| {
                let h = mix(base ^ i);
                // A finite f16: exponent below 31.
                let bits = (h % 0x7800) as u16 | (((h >> 32) & 1) as u16 * 0x8000);
                bits.to_le_bytes()
            })
            .collect()
    }

    /// A write message: `heads` of `layer`, positions `from..to`.
    pub fn kv(&self, id: SeqId, layer: u32, heads: Range<u32>, from: u64, to: u64) -> bytes::Bytes {
        let seq = &self.seqs[&id];
        let mut out = Vec::new();
        for h in heads {
            let lane = SeqModel::lane(layer, h);
            for value in [false, true] {
                for pos in from..to {
                    out.extend(self.row(id, seq, lane, pos, value));
                }
            }
        }
        out.into()
    }

    /// K rows then V rows of `rows` rows of page `page` of `lane`.
    fn page_bytes(&self, id: SeqId, seq: &SeqModel, lane: usize, page: u64, rows: u64) -> Vec<u8> {
        let positions = page * PAGE..page * PAGE + rows;
        let k = positions.clone().flat_map(|p| self.row(id, seq, lane, p, false));
        let v = positions.flat_map(|p| self.row(id, seq, lane, p, true));
        k.chain(v).collect()
    }

    /// Counts one acknowledged operation; returns its number.
    pub fn acked(&mut self, commits: bool) -> u64 {
        self.op += 1;
        if commits {
            self.committed = self.op;
        }
        self.op
    }

    pub fn created(&mut self, id: SeqId, prefix: Option<u8>, attached_pages: u64) {
        let incarnation = self.incarnations.entry(id).or_default();
        *incarnation += 1;
        let created = self.acked(false);
        let mut lane = LaneModel {
            rows: attached_pages * PAGE,
            ..LaneModel::default()
        };
        lane.extend_to(lane.rows);
        let seq = SeqModel {
            incarnation: self.incarnations[&id],
            prefix,
            created,
            lanes: vec![lane; LANES],
        };
        self.seqs.insert(id, seq);
    }

    /// A create a crash cut off: the sequence may exist after the restart
    /// (with its prefix attached), or not.
    pub fn created_unsure(&mut self, id: SeqId, prefix: Option<u8>) {
        self.created(id, prefix, 0);
        self.unsure(id);
        if prefix.is_some() {
            let seq = self.seqs.get_mut(&id).expect("just created");
            for lane in &mut seq.lanes {
                lane.extend_to(PREFIX_PAGES * PAGE);
            }
        }
    }

    /// A drop a crash cut off: the sequence may still exist, as it was.
    pub fn maybe_dropped(&mut self, id: SeqId) {
        self.unsure(id);
    }

    /// The sequence need not exist after the next restart.
    fn unsure(&mut self, id: SeqId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.created = u64::MAX;
        }
    }

    pub fn dropped(&mut self, id: SeqId) {
        self.seqs.remove(&id);
        self.acked(true);
    }

    /// Whether appending to `heads` of `layer` is refused: a last page is
    /// partial and no longer holds its original bytes.
    pub fn append_refused(&self, id: SeqId, layer: u32, heads: Range<u32>) -> bool {
        let seq = &self.seqs[&id];
        heads.into_iter().any(|h| {
            let lane = &seq.lanes[SeqModel::lane(layer, h)];
            !lane.rows.is_multiple_of(PAGE) && lane.fates.last() != Some(&Fate::Bytes)
        })
    }

    /// `n` rows written to `heads` of `layer`: acknowledged (`persist`:
    /// durable from the lane's start), or cut off by a crash (`acked`
    /// false: they may exist).
    pub fn wrote(&mut self, id: SeqId, layer: u32, heads: Range<u32>, n: u64, persist: bool, acked: bool) {
        let seq = self.seqs.get_mut(&id).expect("written sequences are modelled");
        for h in heads {
            let lane = &mut seq.lanes[SeqModel::lane(layer, h)];
            let end = lane.rows + n;
            lane.extend_to(end);
            if acked {
                lane.rows = end;
                if persist {
                    lane.durable = end;
                }
            }
        }
        if acked {
            self.durable_writes += u64::from(persist);
            self.acked(persist);
        }
    }

    /// Whether `fate` may take `change` (evict: anything not gone;
    /// summarize: original bytes only).
    fn legal(fate: Fate, change: Fate) -> bool {
        match change {
            Fate::Gone(_) => !matches!(fate, Fate::Gone(_)),
            Fate::Summary => fate == Fate::Bytes,
            _ => unreachable!("changes are gone or summary"),
        }
    }

    /// Whether changing page `page` of `heads` of `layer` to `change` is
    /// legal (all or nothing).
    pub fn change_allowed(&self, id: SeqId, layer: u32, heads: Range<u32>, page: u64, change: Fate) -> bool {
        let seq = &self.seqs[&id];
        heads
            .into_iter()
            .all(|h| Self::legal(seq.lanes[SeqModel::lane(layer, h)].fates[page as usize], change))
    }

    /// Page `page` of `heads` of `layer` changed to `change`, or (not
    /// `acked`) may have.
    pub fn changed(&mut self, id: SeqId, layer: u32, heads: Range<u32>, page: u64, change: Fate, acked: bool) {
        let seq = self.seqs.get_mut(&id).expect("changed sequences are modelled");
        for h in heads {
            let fate = &mut seq.lanes[SeqModel::lane(layer, h)].fates[page as usize];
            *fate = match (acked, change, *fate) {
                (true, change, _) => change,
                (false, Fate::Summary, _) => Fate::MaybeSummary,
                (false, Fate::Gone(reason), Fate::Summary) => Fate::SummaryMaybeGone(reason),
                (false, Fate::Gone(reason), _) => Fate::MaybeGone(reason),
                (false, ..) => unreachable!("changes are gone or summary"),
            };
        }
        if acked {
            self.acked(true);
        }
    }

    /// A policy over `layer` with `action` (an evict or summary fate; None
    /// for offload) was cut off by a crash: every page with its bytes may
    /// have changed.
    pub fn policy_unsure(&mut self, id: SeqId, layer: u32, action: Option<Fate>) {
        let Some(change) = action else { return };
        let seq = self.seqs.get_mut(&id).expect("modelled");
        for h in 0..HEADS {
            for fate in &mut seq.lanes[SeqModel::lane(layer, h)].fates {
                if *fate == Fate::Bytes {
                    *fate = match change {
                        Fate::Summary => Fate::MaybeSummary,
                        Fate::Gone(r) => Fate::MaybeGone(r),
                        _ => unreachable!("changes are gone or summary"),
                    };
                }
            }
        }
    }

    /// Reads every modelled sequence back and checks it. `crashed`: the
    /// server restarted after a kill or a stop, so unacknowledged work may
    /// be gone and in-flight work may have happened; the model then adopts
    /// what it read. Otherwise everything must match exactly. `changes`:
    /// after a policy the model did not predict, (sequence, layer, fate):
    /// the pages it changed there (original bytes to the fate) are adopted
    /// too.
    /// Returns what this check found (also added to `findings`).
    pub async fn check(&mut self, client: &Client, crashed: bool, changes: Option<(SeqId, u32, Fate)>) -> Findings {
        let mut findings = Findings::default();
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            let mut c = client.clone().with_tenant(id.tenant());
            match c.get_sequence(&id.name()).await {
                Ok(_) => {}
                Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => {
                    let required = !crashed || self.seqs[&id].created <= self.committed;
                    if required {
                        findings.violation(format!("{id:?} is missing: {s:?}"));
                    }
                    self.seqs.remove(&id);
                    continue;
                }
                Err(e) => {
                    findings.violation(format!("{id:?} could not be read: {e}"));
                    continue;
                }
            }
            let mut gone_seen: BTreeMap<i32, u64> = BTreeMap::new();
            for layer in 0..LAYERS {
                let pages = match c.fetch_pages(&id.name(), layer, 0..HEADS, vec![]).await {
                    Ok(p) => p,
                    Err(e) => {
                        findings.violation(format!("{id:?} layer {layer}: fetch failed: {e}"));
                        continue;
                    }
                };
                let adopt = changes.filter(|&(c, l, _)| c == id && l == layer).map(|(.., f)| f);
                for h in 0..HEADS {
                    let lane = SeqModel::lane(layer, h);
                    let read: Vec<&pb::Page> = pages.iter().filter(|p| p.kv_head == h).collect();
                    self.check_lane(id, lane, &read, crashed, adopt, &mut findings);
                    for p in read.iter().filter(|p| p.state() == pb::PageState::Gone) {
                        *gone_seen.entry(p.gone_reason).or_default() += 1;
                    }
                }
            }
            // After the reads: a read may find a page's copy corrupt.
            let reported: BTreeMap<i32, u64> = match c.get_sequence(&id.name()).await {
                Ok(info) => info.gone.iter().map(|g| (g.reason, g.pages)).collect(),
                Err(e) => {
                    findings.violation(format!("{id:?} vanished while being read: {e}"));
                    continue;
                }
            };
            if reported != gone_seen {
                findings.violation(format!(
                    "{id:?}: GetSequence reports gone pages {reported:?}, FetchPages shows {gone_seen:?}"
                ));
            }
        }
        self.findings.merge(findings.clone());
        findings
    }

    fn check_lane(
        &mut self,
        id: SeqId,
        lane: usize,
        read: &[&pb::Page],
        crashed: bool,
        adopt: Option<Fate>,
        findings: &mut Findings,
    ) {
        let seq = &self.seqs[&id];
        let model = &seq.lanes[lane];
        let length: u64 = read.iter().map(|p| u64::from(p.tokens)).sum();
        let (low, high) = if crashed {
            (model.durable, model.attempted)
        } else {
            (model.rows, model.rows)
        };
        if length < model.durable {
            findings.durable_rows_lost += model.durable - length;
            findings.note(format!(
                "{id:?} lane {lane}: {} rows acknowledged durable, {length} came back",
                model.durable
            ));
        } else if length < low || length > high {
            findings.violation(format!(
                "{id:?} lane {lane}: {length} rows, the model allows {low}..={high}"
            ));
        }
        let mut fates = Vec::with_capacity(read.len());
        for (i, page) in read.iter().enumerate() {
            let p = i as u64;
            let rows = u64::from(page.tokens);
            let at = format!("{id:?} lane {lane} page {p}");
            if page.page as u64 != p || rows != PAGE.min(length.saturating_sub(p * PAGE)) {
                findings.violation(format!("{at}: read as page {} with {rows} rows", page.page));
            }
            let expected = model.fates.get(i).copied();
            let state = page.state();
            let label = match state {
                pb::PageState::Gone => format!("gone({})", page.gone_reason().as_str_name()),
                other => other.as_str_name().to_owned(),
            };
            *findings.pages_by_state.entry(label).or_default() += 1;
            let seen = match state {
                pb::PageState::Hot | pb::PageState::Cold => {
                    if page.kv[..] != self.page_bytes(id, seq, lane, p, rows)[..] {
                        findings.wrong_bytes += 1;
                        findings.note(format!("{at}: wrong bytes served"));
                    }
                    Fate::Bytes
                }
                pb::PageState::Summary => {
                    let total: u64 = page.summary_counts.iter().map(|c| u64::from(*c)).sum();
                    if total != rows {
                        findings.violation(format!("{at}: a summary of {total} tokens in a page of {rows}"));
                    }
                    Fate::Summary
                }
                _ => Fate::Gone(page.gone_reason()),
            };
            let durable = p * PAGE < model.durable;
            let had_bytes = matches!(expected, Some(Fate::Bytes | Fate::MaybeSummary | Fate::MaybeGone(_)));
            let allowed = match (expected, seen) {
                (Some(e), s) if e == s => true,
                (Some(Fate::MaybeSummary), Fate::Bytes | Fate::Summary) => true,
                (Some(Fate::MaybeGone(r)), s) if s == Fate::Bytes || s == Fate::Gone(r) => true,
                (Some(Fate::SummaryMaybeGone(r)), s) if s == Fate::Summary || s == Fate::Gone(r) => true,
                // A corrupted NVMe block takes the page it held.
                (_, Fate::Gone(pb::Reason::Integrity)) if had_bytes => self.corruptions > 0,
                // Rows not acknowledged durable may be lost in a crash.
                (_, Fate::Gone(pb::Reason::LostOnRestart)) if had_bytes => crashed && !durable,
                (Some(Fate::Bytes), s) => adopt == Some(s),
                _ => false,
            };
            if !allowed {
                let lost = seen == Fate::Gone(pb::Reason::LostOnRestart) && durable;
                if lost {
                    findings.durable_rows_lost += rows.min(model.durable - p * PAGE);
                } else if matches!(expected, Some(Fate::Gone(_) | Fate::Summary)) {
                    findings.fate_changed += 1;
                } else {
                    findings.other += 1;
                }
                findings.note(format!("{at}: the model has {expected:?}, the server {seen:?}"));
            }
            fates.push(seen);
        }
        let lane_model = &mut self.seqs.get_mut(&id).expect("checked").lanes[lane];
        lane_model.rows = length;
        lane_model.attempted = length;
        lane_model.durable = lane_model.durable.min(length);
        lane_model.fates = fates;
    }
}
