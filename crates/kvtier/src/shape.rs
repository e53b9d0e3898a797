//! A model's KV shape, by preset or given: what the decode benchmark, the
//! trace reader and `tune` size their sequences by.

use kvtier_client::pb;

/// A model's KV shape.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Shape {
    pub(crate) name: String,
    pub(crate) layers: u32,
    pub(crate) kv_heads: u32,
    pub(crate) query_heads: u32,
    pub(crate) head_dim: u32,
    pub(crate) dtype: &'static str,
    pub(crate) page_size: u32,
}

impl Shape {
    pub(crate) fn preset(name: &str, page_size: u32) -> anyhow::Result<Self> {
        let (layers, kv_heads, query_heads, head_dim, dtype) = match name {
            "llama3-8b" => (32, 8, 32, 128, "bf16"),
            "smollm2-135m" => (30, 3, 9, 64, "f16"),
            other => anyhow::bail!("unknown preset {other:?} (llama3-8b, smollm2-135m, or custom)"),
        };
        Ok(Self {
            name: name.into(),
            layers,
            kv_heads,
            query_heads,
            head_dim,
            dtype,
            page_size,
        })
    }

    /// A shape from its parts; `dtype` is f32, f16 or bf16.
    pub(crate) fn custom(
        [layers, kv_heads, query_heads, head_dim]: [u32; 4],
        dtype: &str,
        page_size: u32,
    ) -> anyhow::Result<Self> {
        let dtype = match dtype {
            "f32" => "f32",
            "f16" => "f16",
            "bf16" => "bf16",
            other => anyhow::bail!("dtype {other:?}: f32, f16 or bf16"),
        };
        Ok(Self {
            name: "custom".into(),
            layers,
            kv_heads,
            query_heads,
            head_dim,
            dtype,
            page_size,
        })
    }

    pub(crate) fn pb_dtype(&self) -> pb::DType {
        match self.dtype {
            "f32" => pb::DType::DtypeF32,
            "f16" => pb::DType::DtypeF16,
            _ => pb::DType::DtypeBf16,
        }
    }

    pub(crate) fn layout(&self) -> pb::Layout {
        kvtier_client::layout(
            self.layers,
            self.kv_heads,
            self.query_heads,
            self.head_dim,
            self.pb_dtype(),
            self.page_size,
        )
    }

    pub(crate) fn element_bytes(&self) -> usize {
        if self.dtype == "f32" { 4 } else { 2 }
    }

    pub(crate) fn row_bytes(&self) -> usize {
        self.head_dim as usize * self.element_bytes()
    }

    pub(crate) fn page_bytes(&self) -> usize {
        2 * self.page_size as usize * self.row_bytes()
    }

    pub(crate) fn group(&self) -> usize {
        (self.query_heads / self.kv_heads) as usize
    }

    pub(crate) fn encode(&self, v: f32, out: &mut Vec<u8>) {
        match self.dtype {
            "f32" => out.extend_from_slice(&v.to_le_bytes()),
            "f16" => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            _ => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
}
