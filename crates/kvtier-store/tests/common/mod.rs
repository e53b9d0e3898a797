//! What the store's tests share.
#![allow(dead_code, unreachable_pub)]

use std::path::Path;

use kvtier_core::{DType, Layout, LayoutSpec};
use kvtier_store::{EngineChoice, NvmeConfig};

/// An NVMe tier of `capacity` bytes in `dir`, 8 I/Os deep.
pub fn nvme(dir: &Path, capacity: u64, direct: bool) -> Option<NvmeConfig> {
    Some(NvmeConfig {
        path: dir.join("nvme.data"),
        capacity,
        engine: EngineChoice::Auto,
        queue_depth: 8,
        direct,
    })
}

/// A layout with one query head per KV head and no layer groups.
pub fn layout(dtype: DType, layers: u32, heads: u32, head_dim: u32, page_size: u32) -> Layout {
    Layout::new(LayoutSpec {
        num_layers: layers,
        num_kv_heads: heads,
        num_query_heads: heads,
        head_dim,
        dtype,
        page_size,
        layer_groups: vec![],
    })
    .unwrap()
}
