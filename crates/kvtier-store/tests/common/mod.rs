//! What the store's tests share.
#![allow(dead_code, unreachable_pub)]

use kvtier_core::{DType, Layout, LayoutSpec};

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
