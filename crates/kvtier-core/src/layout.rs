//! The model layout a sequence is created with (layers, heads, head size,
//! dtype, page size, shared-KV layer groups) and the sizes derived from it.

use crate::wire;
use crate::{DType, FieldError};

/// Layers `[first_layer, first_layer + num_layers)` read one shared KV
/// (cross-layer attention, YOCO). The shared KV is stored and counted once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerGroup {
    /// First layer of the group, 0-based.
    pub first_layer: u32,
    /// Layers in the group; at least 2.
    pub num_layers: u32,
}

/// A layout as a client states it, before validation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LayoutSpec {
    /// Model layers, `1..=MAX_LAYERS`.
    pub num_layers: u32,
    /// KV heads per layer, `1..=MAX_KV_HEADS`.
    pub num_kv_heads: u32,
    /// Query heads per layer, `1..=MAX_QUERY_HEADS`; a multiple of `num_kv_heads`.
    pub num_query_heads: u32,
    /// Elements per K or V row, `1..=MAX_HEAD_DIM`.
    pub head_dim: u32,
    /// Element type of keys and values.
    pub dtype: DType,
    /// Tokens per page, `1..=MAX_PAGE_SIZE`.
    pub page_size: u32,
    /// Groups of layers that read one shared KV; must not overlap. Empty when
    /// every layer stores its own.
    pub layer_groups: Vec<LayerGroup>,
}

/// A validated model layout. All sizes derived from it fit in `u64` with
/// room to spare, and every page is `page_bytes()` long in every tier.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    spec: LayoutSpec,
    /// For every layer, the index of the stored KV it reads.
    kv_layer_of: Vec<u32>,
    num_kv_layers: u32,
}

impl LayoutSpec {
    /// Largest `num_layers` accepted.
    pub const MAX_LAYERS: u32 = 1024;
    /// Largest `num_kv_heads` accepted.
    pub const MAX_KV_HEADS: u32 = 1024;
    /// Largest `num_query_heads` accepted.
    pub const MAX_QUERY_HEADS: u32 = 8192;
    /// Largest `head_dim` accepted, in elements.
    pub const MAX_HEAD_DIM: u32 = 1024;
    /// Largest `page_size` accepted, in tokens.
    pub const MAX_PAGE_SIZE: u32 = 1024;
}

impl Layout {
    /// Validates `spec` (every size in range, query heads a multiple of KV
    /// heads, layer groups of at least 2 layers, in range and disjoint) and
    /// numbers its stored KV layers. Errors name the offending `layout.*` field.
    pub fn new(spec: LayoutSpec) -> Result<Self, FieldError> {
        fn within(field: wire::Field, value: u32, max: u32) -> Result<(), FieldError> {
            if value == 0 || value > max {
                return Err(FieldError::new(field, format!("is {value}, must be in 1..={max}")));
            }
            Ok(())
        }
        within(wire::LAYOUT_NUM_LAYERS, spec.num_layers, LayoutSpec::MAX_LAYERS)?;
        within(wire::LAYOUT_NUM_KV_HEADS, spec.num_kv_heads, LayoutSpec::MAX_KV_HEADS)?;
        within(
            wire::LAYOUT_NUM_QUERY_HEADS,
            spec.num_query_heads,
            LayoutSpec::MAX_QUERY_HEADS,
        )?;
        within(wire::LAYOUT_HEAD_DIM, spec.head_dim, LayoutSpec::MAX_HEAD_DIM)?;
        within(wire::LAYOUT_PAGE_SIZE, spec.page_size, LayoutSpec::MAX_PAGE_SIZE)?;
        if !spec.num_query_heads.is_multiple_of(spec.num_kv_heads) {
            return Err(FieldError::new(
                wire::LAYOUT_NUM_QUERY_HEADS,
                format!(
                    "is {}, must be a multiple of num_kv_heads ({})",
                    spec.num_query_heads, spec.num_kv_heads
                ),
            ));
        }
        let mut group_of: Vec<Option<usize>> = vec![None; spec.num_layers as usize];
        for (g, group) in spec.layer_groups.iter().enumerate() {
            let field = wire::LAYOUT_LAYER_GROUPS.at(g);
            if group.num_layers < 2 {
                return Err(FieldError::new(
                    field,
                    format!("has {} layers; a shared-KV group needs at least 2", group.num_layers),
                ));
            }
            let end = u64::from(group.first_layer) + u64::from(group.num_layers);
            if end > u64::from(spec.num_layers) {
                return Err(FieldError::new(
                    field,
                    format!(
                        "covers layers {}..{end}, beyond num_layers ({})",
                        group.first_layer, spec.num_layers
                    ),
                ));
            }
            for layer in group.first_layer..end as u32 {
                if let Some(other) = group_of[layer as usize].replace(g) {
                    return Err(FieldError::new(
                        field,
                        format!("overlaps layer_groups[{other}] at layer {layer}"),
                    ));
                }
            }
        }
        // Number stored KV layers in layer order; a group takes the index of
        // its first layer's position.
        let mut kv_layer_of = Vec::with_capacity(spec.num_layers as usize);
        let mut group_kv: Vec<Option<u32>> = vec![None; spec.layer_groups.len()];
        let mut next = 0u32;
        for g in &group_of {
            let kv = match g {
                Some(g) => *group_kv[*g].get_or_insert_with(|| {
                    next += 1;
                    next - 1
                }),
                None => {
                    next += 1;
                    next - 1
                }
            };
            kv_layer_of.push(kv);
        }
        Ok(Self {
            spec,
            kv_layer_of,
            num_kv_layers: next,
        })
    }

    /// The validated spec.
    pub fn spec(&self) -> &LayoutSpec {
        &self.spec
    }
    /// Model layers, counting each layer of a group.
    pub fn num_layers(&self) -> u32 {
        self.spec.num_layers
    }
    /// KV heads per layer.
    pub fn num_kv_heads(&self) -> u32 {
        self.spec.num_kv_heads
    }
    /// Query heads per layer.
    pub fn num_query_heads(&self) -> u32 {
        self.spec.num_query_heads
    }
    /// Elements per K or V row.
    pub fn head_dim(&self) -> u32 {
        self.spec.head_dim
    }
    /// Element type of keys and values.
    pub fn dtype(&self) -> DType {
        self.spec.dtype
    }
    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.spec.page_size
    }
    /// Query heads per KV head (GQA group size).
    pub fn group_size(&self) -> u32 {
        self.spec.num_query_heads / self.spec.num_kv_heads
    }
    /// Number of distinct stored KV layers (fewer than layers with groups).
    pub fn num_kv_layers(&self) -> u32 {
        self.num_kv_layers
    }
    /// The stored KV layer that `layer` reads. `layer` must be in range.
    pub fn kv_layer(&self, layer: u32) -> u32 {
        self.kv_layer_of[layer as usize]
    }
    /// Number of (stored layer, KV head) lanes, each an append-only run of pages.
    pub fn num_lanes(&self) -> usize {
        self.num_kv_layers as usize * self.spec.num_kv_heads as usize
    }
    /// Lane index of (layer, kv_head); both must be in range.
    pub fn lane(&self, layer: u32, kv_head: u32) -> usize {
        self.kv_layer(layer) as usize * self.spec.num_kv_heads as usize + kv_head as usize
    }
    /// Bytes of one K (or V) row: `head_dim` elements.
    pub fn row_bytes(&self) -> usize {
        self.spec.head_dim as usize * self.spec.dtype.size()
    }
    /// Bytes of one full page: K rows `[page_size][head_dim]`, then V rows.
    pub fn page_bytes(&self) -> usize {
        2 * self.spec.page_size as usize * self.row_bytes()
    }
    /// Pages needed to hold `tokens` positions.
    pub fn pages_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.spec.page_size))
    }
    /// Valid rows of page `page` in a lane holding `tokens` positions.
    pub fn rows_in_page(&self, tokens: u64, page: u64) -> u32 {
        let p = u64::from(self.spec.page_size);
        tokens.saturating_sub(page * p).min(p) as u32
    }
    /// The layer group containing `layer`, if any.
    pub fn group_of(&self, layer: u32) -> Option<&LayerGroup> {
        self.spec
            .layer_groups
            .iter()
            .find(|g| (g.first_layer..g.first_layer + g.num_layers).contains(&layer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn spec() -> LayoutSpec {
        LayoutSpec {
            num_layers: 4,
            num_kv_heads: 2,
            num_query_heads: 8,
            head_dim: 64,
            dtype: DType::F16,
            page_size: 16,
            layer_groups: vec![],
        }
    }

    #[test]
    fn sizes_follow_the_layout() {
        let l = Layout::new(spec()).unwrap();
        assert_eq!(l.row_bytes(), 128);
        assert_eq!(l.page_bytes(), 2 * 16 * 128);
        assert_eq!(l.group_size(), 4);
        assert_eq!(l.pages_for(0), 0);
        assert_eq!(l.pages_for(17), 2);
        assert_eq!(l.rows_in_page(17, 0), 16);
        assert_eq!(l.rows_in_page(17, 1), 1);
        assert_eq!(l.rows_in_page(17, 2), 0);
    }

    #[test]
    fn each_bad_field_is_named() {
        type Mutation = Box<dyn Fn(&mut LayoutSpec)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|s| s.num_layers = 0), "layout.num_layers"),
            (Box::new(|s| s.num_kv_heads = 0), "layout.num_kv_heads"),
            (Box::new(|s| s.num_query_heads = 7), "layout.num_query_heads"),
            (Box::new(|s| s.head_dim = 2000), "layout.head_dim"),
            (Box::new(|s| s.page_size = 0), "layout.page_size"),
            (Box::new(|s| s.page_size = 1025), "layout.page_size"),
            (
                Box::new(|s| {
                    s.layer_groups = vec![LayerGroup {
                        first_layer: 3,
                        num_layers: 2,
                    }]
                }),
                "layout.layer_groups[0]",
            ),
            (
                Box::new(|s| {
                    s.layer_groups = vec![
                        LayerGroup {
                            first_layer: 0,
                            num_layers: 2,
                        },
                        LayerGroup {
                            first_layer: 1,
                            num_layers: 2,
                        },
                    ]
                }),
                "layout.layer_groups[1]",
            ),
            (
                Box::new(|s| {
                    s.layer_groups = vec![LayerGroup {
                        first_layer: 0,
                        num_layers: 1,
                    }]
                }),
                "layout.layer_groups[0]",
            ),
        ];
        for (mutate, field) in cases {
            let mut s = spec();
            mutate(&mut s);
            assert_eq!(Layout::new(s).unwrap_err().field, field);
        }
        assert!(Layout::new(LayoutSpec { page_size: 1, ..spec() }).is_ok());
        assert!(
            Layout::new(LayoutSpec {
                page_size: 1024,
                ..spec()
            })
            .is_ok()
        );
    }

    #[test]
    fn layer_groups_share_one_stored_layer() {
        // YOCO-like: layers 2 and 3 read one KV.
        let l = Layout::new(LayoutSpec {
            layer_groups: vec![LayerGroup {
                first_layer: 2,
                num_layers: 2,
            }],
            ..spec()
        })
        .unwrap();
        assert_eq!(l.num_kv_layers(), 3);
        assert_eq!((0..4).map(|x| l.kv_layer(x)).collect::<Vec<_>>(), [0, 1, 2, 2]);
        assert_eq!(l.lane(3, 1), l.lane(2, 1));
        assert_eq!(l.num_lanes(), 6);
        // CLA-like: pairs.
        let l = Layout::new(LayoutSpec {
            layer_groups: vec![
                LayerGroup {
                    first_layer: 0,
                    num_layers: 2,
                },
                LayerGroup {
                    first_layer: 2,
                    num_layers: 2,
                },
            ],
            ..spec()
        })
        .unwrap();
        assert_eq!((0..4).map(|x| l.kv_layer(x)).collect::<Vec<_>>(), [0, 0, 1, 1]);
    }
}
