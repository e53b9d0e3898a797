//! Conversions between `kvtier.v1` messages and store types. Every refusal
//! names the protobuf field.

use kvtier_core::rank::{DEFAULT_CANDIDATES, DEFAULT_MODE, Mode, Ranking};
use kvtier_core::select::{Aggregation, Ownership, Scope, Shard, TopP};
use kvtier_core::{Action, ColdTier, DType, LayerGroup, Layout, LayoutSpec, PageState, Reason, SequenceKey, wire};
use kvtier_proto::v1 as pb;
use kvtier_store::{
    HeadRange, HeadSelection, PrefetchCounts, SequenceInfo, StateCounts, StatsSnapshot, TierBytes, TierKind,
    TransitionCount, Usage,
};
use tonic::Status;

use crate::status::{field_status, invalid};

/// KV heads `start..start + count`.
pub(crate) fn heads(start: u32, count: u32) -> HeadRange {
    HeadRange { start, count }
}

pub(crate) fn key(tenant: &str, sequence_id: &str) -> Result<SequenceKey, Status> {
    SequenceKey::parse(tenant, sequence_id).map_err(field_status)
}

/// Decodes a proto enum field, refusing unknown and unspecified values.
fn enum_field<E: TryFrom<i32>>(field: wire::Field, value: i32, names: &str) -> Result<E, Status> {
    if value == 0 {
        return Err(invalid(field, format!("is required ({names})")));
    }
    E::try_from(value).map_err(|_| invalid(field, format!("{value} is not one of {names}")))
}

pub(crate) fn layout(layout: Option<pb::Layout>) -> Result<Layout, Status> {
    let l = layout.ok_or_else(|| invalid(wire::LAYOUT, "is required"))?;
    let dtype = match enum_field(wire::LAYOUT_DTYPE, l.dtype, "DTYPE_F32, DTYPE_F16, DTYPE_BF16")? {
        pb::DType::DtypeF32 => DType::F32,
        pb::DType::DtypeF16 => DType::F16,
        pb::DType::DtypeBf16 => DType::Bf16,
        pb::DType::DtypeUnspecified => unreachable!("refused by enum_field"),
    };
    Layout::new(LayoutSpec {
        num_layers: l.num_layers,
        num_kv_heads: l.num_kv_heads,
        num_query_heads: l.num_query_heads,
        head_dim: l.head_dim,
        dtype,
        page_size: l.page_size,
        layer_groups: l
            .layer_groups
            .iter()
            .map(|g| LayerGroup {
                first_layer: g.first_layer,
                num_layers: g.num_layers,
            })
            .collect(),
    })
    .map_err(field_status)
}

/// A create's context-parallel group, checked.
pub(crate) fn group(group: Option<pb::PlacementGroup>) -> Result<Option<kvtier_cluster::Group>, Status> {
    let Some(g) = group else { return Ok(None) };
    // The name places the group's shards as a sequence id would.
    kvtier_core::SequenceId::parse(wire::GROUP_NAME.path, &g.name).map_err(field_status)?;
    if !(1..=4096).contains(&g.world) {
        return Err(invalid(wire::GROUP_WORLD, format!("is {}, must be 1..=4096", g.world)));
    }
    if g.rank >= g.world {
        return Err(invalid(
            wire::GROUP_RANK,
            format!("is {}, must be below group.world ({})", g.rank, g.world),
        ));
    }
    Ok(Some(kvtier_cluster::Group {
        name: g.name,
        rank: g.rank,
        world: g.world,
    }))
}

pub(crate) fn layout_to_pb(l: &Layout) -> pb::Layout {
    let s = l.spec();
    pb::Layout {
        num_layers: s.num_layers,
        num_kv_heads: s.num_kv_heads,
        num_query_heads: s.num_query_heads,
        head_dim: s.head_dim,
        dtype: match s.dtype {
            DType::F32 => pb::DType::DtypeF32,
            DType::F16 => pb::DType::DtypeF16,
            DType::Bf16 => pb::DType::DtypeBf16,
        } as i32,
        page_size: s.page_size,
        layer_groups: s
            .layer_groups
            .iter()
            .map(|g| pb::LayerGroup {
                first_layer: g.first_layer,
                num_layers: g.num_layers,
            })
            .collect(),
    }
}

/// The state as (state, cold tier); the tier is unspecified unless cold.
pub(crate) fn state_to_pb(state: PageState) -> (pb::PageState, pb::Tier) {
    match state {
        PageState::Hot => (pb::PageState::Hot, pb::Tier::Unspecified),
        PageState::Cold(tier) => (pb::PageState::Cold, cold_tier_to_pb(tier)),
        PageState::Summary => (pb::PageState::Summary, pb::Tier::Unspecified),
        PageState::Gone => (pb::PageState::Gone, pb::Tier::Unspecified),
    }
}

fn cold_tier_to_pb(tier: ColdTier) -> pb::Tier {
    match tier {
        ColdTier::Host => pb::Tier::Host,
        ColdTier::Nvme => pb::Tier::Nvme,
    }
}

pub(crate) fn reason_to_pb(reason: Reason) -> pb::Reason {
    match reason {
        Reason::Explicit => pb::Reason::Explicit,
        Reason::CapacityPressure => pb::Reason::Capacity,
        Reason::Demand => pb::Reason::Demand,
        Reason::Prefetch => pb::Reason::Prefetch,
        Reason::Policy => pb::Reason::Policy,
        Reason::Integrity => pb::Reason::Integrity,
        Reason::LostOnRestart => pb::Reason::LostOnRestart,
    }
}

pub(crate) fn cold_tier(field: wire::Field, tier: i32) -> Result<ColdTier, Status> {
    match enum_field(field, tier, "TIER_HOST, TIER_NVME")? {
        pb::Tier::Host => Ok(ColdTier::Host),
        pb::Tier::Nvme => Ok(ColdTier::Nvme),
        pb::Tier::Device => Err(invalid(field, "must be a cold tier (TIER_HOST or TIER_NVME)")),
        pb::Tier::Unspecified => unreachable!("refused by enum_field"),
    }
}

/// The action and, for summaries, the rows per summary.
pub(crate) fn action(action: Option<pb::set_page_state_request::Action>) -> Result<(Action, u32), Status> {
    use pb::set_page_state_request::Action as A;
    match action {
        None => Err(invalid(
            wire::ACTION,
            "is required (offload, swap_in, migrate, summarize or evict)",
        )),
        Some(A::Offload(o)) => Ok((Action::Offload(cold_tier(wire::OFFLOAD_TIER, o.tier)?), 0)),
        Some(A::SwapIn(_)) => Ok((Action::SwapIn, 0)),
        Some(A::Migrate(m)) => Ok((Action::Migrate(cold_tier(wire::MIGRATE_TIER, m.tier)?), 0)),
        Some(A::Summarize(s)) if s.rows == 0 => Err(invalid(wire::SUMMARIZE_ROWS, "must be at least 1")),
        Some(A::Summarize(s)) => Ok((Action::Summarize, s.rows)),
        Some(A::Evict(_)) => Ok((Action::Evict, 0)),
    }
}

fn counts_to_pb(c: &StateCounts) -> pb::PageCounts {
    pb::PageCounts {
        hot: c.get(PageState::Hot),
        cold_host: c.get(PageState::Cold(ColdTier::Host)),
        cold_nvme: c.get(PageState::Cold(ColdTier::Nvme)),
        summary: c.get(PageState::Summary),
        gone: c.get(PageState::Gone),
    }
}

/// A node's membership view, as `GetCluster` answers it.
pub(crate) fn cluster_to_pb(node: &kvtier_cluster::Node) -> pb::ClusterView {
    let view = node.view();
    let bytes = |b: &kvtier_cluster::TierBytes| pb::TierBytes {
        device: b.device,
        host: b.host,
        nvme: b.nvme,
    };
    pb::ClusterView {
        cluster: node.cluster().to_owned(),
        node_id: node.id().to_owned(),
        revision: view.revision,
        current: view.current,
        nodes: view
            .members()
            .map(|m| pb::ClusterNode {
                node_id: m.node_id.clone(),
                addr: m.addr.clone(),
                state: m.state.as_str().to_owned(),
                version: m.version.clone(),
                capacity: Some(bytes(&m.capacity)),
                free: Some(bytes(&m.free)),
            })
            .collect(),
    }
}

fn bytes_to_pb(b: &TierBytes) -> pb::TierBytes {
    pb::TierBytes {
        device: b.device,
        host: b.host,
        nvme: b.nvme,
    }
}

pub(crate) fn info_to_pb(info: &SequenceInfo) -> pb::SequenceInfo {
    pb::SequenceInfo {
        layout: Some(layout_to_pb(&info.layout)),
        tokens: info.tokens,
        max_tokens: info.max_tokens,
        pages: Some(counts_to_pb(&info.pages)),
        bytes: Some(bytes_to_pb(&info.bytes)),
        shared_pages: info.shared_pages,
        digest_bytes: info.digest_bytes,
        prefix_hashes: info.prefix_hashes,
        gone: info
            .gone_by_reason
            .iter()
            .map(|(reason, pages)| pb::ReasonCount {
                reason: reason_to_pb(*reason) as i32,
                pages: *pages,
            })
            .collect(),
        // The store knows no incarnations; a node in a cluster sets it.
        incarnation: 0,
    }
}

fn tier_kind_to_pb(kind: TierKind) -> pb::Tier {
    match kind {
        TierKind::Device => pb::Tier::Device,
        TierKind::Host => pb::Tier::Host,
        TierKind::Nvme => pb::Tier::Nvme,
    }
}

fn transition_to_pb(t: &TransitionCount) -> pb::TransitionCount {
    let (from_state, from_tier) = state_to_pb(t.from);
    let (to_state, to_tier) = state_to_pb(t.to);
    pb::TransitionCount {
        from_state: from_state as i32,
        from_tier: from_tier as i32,
        to_state: to_state as i32,
        to_tier: to_tier as i32,
        reason: reason_to_pb(t.reason) as i32,
        count: t.count,
    }
}

/// The store's statistics, with the shared-memory regions' count and bytes.
pub(crate) fn stats_to_pb(s: &StatsSnapshot, (shm_regions, shm_region_bytes): (u64, u64)) -> pb::Stats {
    pb::Stats {
        shm_regions,
        shm_region_bytes,
        tenant: s.tenant.as_ref().map_or_else(String::new, |t| t.as_str().to_owned()),
        tiers: s
            .tiers
            .iter()
            .map(|t| pb::TierStats {
                tier: tier_kind_to_pb(t.kind) as i32,
                backend: t.backend.to_owned(),
                emulated: t.emulated,
                capacity_bytes: t.capacity_bytes,
                used_bytes: t.used_bytes,
                slots: t.slots,
            })
            .collect(),
        pages: Some(counts_to_pb(&s.pages)),
        sequences: s.sequences,
        physical_pages: s.physical_pages,
        transitions: s.transitions.iter().map(transition_to_pb).collect(),
        pages_written: s.pages_written,
        pages_shared: s.pages_shared,
        bytes_written: s.bytes_written,
        bytes_read: s.bytes_read,
        tokens_appended: s.tokens_appended,
        swapped_from_host: s.swapped_from_host,
        swapped_from_nvme: s.swapped_from_nvme,
        prefetch_issued: s.prefetch.issued + s.layer_ahead.issued,
        prefetch_used: s.prefetch.used + s.layer_ahead.used,
        prefetch_wasted: s.prefetch.wasted + s.layer_ahead.wasted,
        prefetch: Some(prefetch_to_pb(&s.prefetch)),
        layer_ahead: Some(prefetch_to_pb(&s.layer_ahead)),
        device_hits: Some(pb::DeviceHits {
            resident: s.device_hits.resident,
            stream: s.device_hits.stream,
            misses: s.device_hits.misses,
        }),
        index: Some(pb::IndexMemory {
            pages: s.index.pages,
            spilled_pages: s.index.spilled_pages,
            sketch_bytes: s.index.sketch_bytes,
        }),
        leases: s.leases,
        metadata_bytes: s.metadata_bytes,
        metadata_limit_bytes: s.metadata_limit_bytes.unwrap_or(0),
        usage: s.usage.as_ref().map(usage_to_pb),
    }
}

fn prefetch_to_pb(p: &PrefetchCounts) -> pb::PrefetchCounts {
    pb::PrefetchCounts {
        issued: p.issued,
        used: p.used,
        late: p.late,
        wasted: p.wasted,
    }
}

fn usage_to_pb(u: &Usage) -> pb::TenantUsage {
    let [device_bytes, host_bytes, nvme_bytes] = u.tier_bytes;
    pb::TenantUsage {
        sequences: u.sequences,
        device_bytes,
        host_bytes,
        nvme_bytes,
        quota: Some(pb::Quota {
            sequences: u.quota.sequences,
            metadata_bytes: u.quota.metadata_bytes,
            device_bytes: u.quota.device_bytes,
            host_bytes: u.quota.host_bytes,
            nvme_bytes: u.quota.nvme_bytes,
        }),
    }
}

/// Little-endian f32 values from a `bytes` field.
pub(crate) fn f32s(field: wire::Field, bytes: &[u8]) -> Result<Vec<f32>, Status> {
    if !bytes.len().is_multiple_of(4) {
        return Err(invalid(
            field,
            format!("is {} bytes, not a whole number of f32 values", bytes.len()),
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// A request's aggregation; `None` when unspecified (the mode's own).
pub(crate) fn aggregation(value: i32) -> Result<Option<Aggregation>, Status> {
    match pb::Aggregation::try_from(value) {
        Ok(pb::Aggregation::Unspecified) => Ok(None),
        Ok(pb::Aggregation::Max) => Ok(Some(Aggregation::Max)),
        Ok(pb::Aggregation::Mean) => Ok(Some(Aggregation::Mean)),
        Ok(pb::Aggregation::PerQueryHead) => Ok(Some(Aggregation::PerQueryHead)),
        Err(_) => Err(invalid(
            wire::AGGREGATION,
            format!("{value} is not one of AGGREGATION_MAX, AGGREGATION_MEAN, AGGREGATION_PER_QUERY_HEAD"),
        )),
    }
}

/// A request's ranking: its mode (unspecified: the default), candidates,
/// softmax scale and top-p, the zeros meaning "the default".
pub(crate) fn ranking(r: &pb::SelectPagesRequest) -> Result<Ranking, Status> {
    let mode = match pb::SelectionMode::try_from(r.mode) {
        Ok(pb::SelectionMode::Unspecified) => DEFAULT_MODE,
        Ok(pb::SelectionMode::Quest) => Mode::Quest,
        Ok(pb::SelectionMode::Cuboid) => Mode::Cuboid,
        Ok(pb::SelectionMode::Sketch) => Mode::Sketch,
        Ok(pb::SelectionMode::TwoStage) => Mode::TwoStage,
        Err(_) => {
            return Err(invalid(
                wire::MODE,
                format!(
                    "{} is not one of SELECTION_MODE_QUEST, SELECTION_MODE_CUBOID, SELECTION_MODE_SKETCH, SELECTION_MODE_TWO_STAGE",
                    r.mode
                ),
            ));
        }
    };
    if r.top_p == 0.0 && r.min_pages > 0 {
        return Err(invalid(wire::MIN_PAGES, "applies to a top-p budget; set top_p too"));
    }
    Ok(Ranking {
        mode,
        candidates: if r.candidates == 0 {
            DEFAULT_CANDIDATES
        } else {
            r.candidates
        },
        softmax_scale: (r.softmax_scale != 0.0).then_some(r.softmax_scale),
        top_p: (r.top_p != 0.0).then_some(TopP {
            p: r.top_p,
            min_pages: r.min_pages as usize,
        }),
        reuse: (r.reuse_similarity != 0.0).then_some(r.reuse_similarity),
    })
}

/// The proto's name for a selection mode (clients that build requests from
/// a `Mode`, such as the decode bench, use this one mapping too).
pub fn mode_to_pb(mode: Mode) -> pb::SelectionMode {
    match mode {
        Mode::Quest => pb::SelectionMode::Quest,
        Mode::Cuboid => pb::SelectionMode::Cuboid,
        Mode::Sketch => pb::SelectionMode::Sketch,
        Mode::TwoStage => pb::SelectionMode::TwoStage,
    }
}

pub(crate) fn shard(shard: Option<pb::ContextShard>) -> Result<Option<Shard>, Status> {
    let Some(s) = shard else { return Ok(None) };
    let ownership = match enum_field(
        wire::SHARD_OWNERSHIP,
        s.ownership,
        "OWNERSHIP_CONTIGUOUS, OWNERSHIP_STRIDED",
    )? {
        pb::Ownership::Contiguous => Ownership::Contiguous,
        pb::Ownership::Strided => Ownership::Strided,
        pb::Ownership::Unspecified => unreachable!("refused by enum_field"),
    };
    let scope = match enum_field(wire::SHARD_SCOPE, s.scope, "SCOPE_GLOBAL, SCOPE_LOCAL")? {
        pb::Scope::Global => Scope::Global,
        pb::Scope::Local => Scope::Local,
        pb::Scope::Unspecified => unreachable!("refused by enum_field"),
    };
    Ok(Some(Shard {
        rank: s.rank,
        world: s.world,
        ownership,
        scope,
    }))
}

pub(crate) fn head_selection_to_pb(h: &HeadSelection) -> pb::HeadSelection {
    pb::HeadSelection {
        kv_head: h.kv_head,
        query_head: h.query_head,
        pages: h
            .pages
            .iter()
            .map(|p| {
                let (state, cold_tier) = state_to_pb(p.state);
                pb::SelectedPage {
                    page: p.page,
                    bound: p.bound,
                    state: state as i32,
                    cold_tier: cold_tier as i32,
                    miss: match p.miss {
                        None => pb::Miss::None,
                        Some(kvtier_store::Miss::Deadline) => pb::Miss::Deadline,
                        Some(kvtier_store::Miss::NoRoom) => pb::Miss::NoRoom,
                    } as i32,
                }
            })
            .collect(),
        selected_but_gone: h.selected_but_gone,
    }
}

pub(crate) fn durability_to_pb(a: kvtier_store::Acknowledged) -> pb::Durability {
    match a {
        kvtier_store::Acknowledged::Memory => pb::Durability::Memory,
        kvtier_store::Acknowledged::Relaxed => pb::Durability::Relaxed,
        kvtier_store::Acknowledged::Fsync => pb::Durability::Fsync,
    }
}

pub(crate) fn timing_to_pb(t: &kvtier_store::SelectTiming) -> pb::SelectTiming {
    pb::SelectTiming {
        rank_us: t.rank_us,
        read_us: t.read_us,
        attend_us: t.attend_us,
        store_us: t.store_us,
        // The server's, stamped by its handler.
        server_us: 0,
    }
}

pub(crate) fn attention_to_pb(a: &kvtier_store::HeadAttention) -> pb::QueryAttention {
    pb::QueryAttention {
        query_head: a.query_head,
        out: a.attention.out.iter().flat_map(|x| x.to_le_bytes()).collect(),
        lse: a.attention.lse,
        tokens: a.attention.tokens,
    }
}

pub(crate) fn append_timing_to_pb(t: &kvtier_store::AppendTiming) -> pb::AppendTiming {
    pb::AppendTiming {
        lock_wait_us: t.lock_wait_us,
        reserve_us: t.reserve_us,
        migration_wait_us: t.migration_wait_us,
        migration_us: t.migration_us,
        durability_us: t.durability_us,
        policy_us: t.policy_us,
        store_us: t.store_us,
    }
}

pub(crate) fn swap_to_pb(s: &kvtier_store::SwapReport) -> pb::SwapReport {
    pb::SwapReport {
        already_hot: s.already_hot,
        from_host: s.from_host,
        from_nvme: s.from_nvme,
        not_hot: s.not_hot,
        host_us: s.host_micros,
        nvme_us: s.nvme_micros,
    }
}
