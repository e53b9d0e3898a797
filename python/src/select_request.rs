//! A SelectPages request built once and sent every decode step with only
//! the step's own fields set: what `kvtier.Client.select_kv_call` holds.
//! The shared fields (sequence, heads, budget's sinks and window, mode,
//! the region's window) are checked and converted from their dict once;
//! each step sets the layer, the queries, the budget and the tokens to
//! append in the generated type and is encoded without reflection.

use bytes::Bytes;
use kvtier_proto::v1 as pb;
use prost_reflect::DynamicMessage;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::reflect;

/// A step's tokens to append, as Python gives them: `(kv_heads,
/// num_tokens, k, v, position, persist)`.
type StepAppend<'a, 'py> = (usize, u32, &'a [u8], &'a [u8], Option<Bound<'py, PyAny>>, bool);

/// A `SelectPagesRequest`: a step's, or the fields the steps share.
#[pyclass(frozen, module = "kvtier._native")]
pub(crate) struct SelectRequest {
    pub(crate) request: pb::SelectPagesRequest,
}

#[pymethods]
impl SelectRequest {
    /// The request `fields` (a dict, as `call` takes it) describe.
    #[new]
    fn new(fields: &Bound<'_, PyAny>) -> PyResult<Self> {
        let method = crate::method("SelectPages")?;
        let dynamic = reflect::to_message(fields, &method.input(), "")?;
        let request = dynamic
            .transcode_to::<pb::SelectPagesRequest>()
            .map_err(|e| PyValueError::new_err(format!("request: {e}")))?;
        Ok(Self { request })
    }

    /// This request for one step: `layer`, `queries` (little-endian f32
    /// bytes), `budget_pages`, and with `append` (`(kv_heads, num_tokens,
    /// k, v, position, persist)`: `k` and `v` each `[kv_heads][num_tokens]`
    /// rows in the layout's dtype) the step's tokens to append once
    /// selected, laid out per head as `AppendAfterSelection.kv` has them.
    #[pyo3(signature = (layer, queries, budget_pages, append=None))]
    fn step(
        &self,
        layer: &Bound<'_, PyAny>,
        queries: &[u8],
        budget_pages: &Bound<'_, PyAny>,
        append: Option<StepAppend<'_, '_>>,
    ) -> PyResult<Self> {
        let mut request = self.request.clone();
        // Converted as `call` converts its dicts: errors name the field.
        request.layer = layer.extract().map_err(reflect::wrong_value("layer"))?;
        request.queries = Bytes::copy_from_slice(queries);
        request.budget_pages = budget_pages.extract().map_err(reflect::wrong_value("budget_pages"))?;
        if let Some((heads, num_tokens, k, v, position, persist)) = append {
            let position = position
                .map(|p| p.extract())
                .transpose()
                .map_err(reflect::wrong_value("append.position"))?;
            request.append = Some(pb::AppendAfterSelection {
                num_tokens,
                kv: interleave(heads, k, v)?,
                position,
                persist,
            });
        }
        Ok(Self { request })
    }
}

/// `k` and `v` (`heads` equal runs of rows each) as one `kv` field: per
/// head its K rows, then its V rows.
fn interleave(heads: usize, k: &[u8], v: &[u8]) -> PyResult<Bytes> {
    if heads == 0 || k.len() != v.len() || !k.len().is_multiple_of(heads) {
        return Err(PyValueError::new_err(format!(
            "append: {} bytes of K and {} of V are not {heads} heads' rows each",
            k.len(),
            v.len()
        )));
    }
    let run = k.len() / heads;
    if run == 0 {
        // No rows: the server refuses the append for its `num_tokens`.
        return Ok(Bytes::new());
    }
    let mut kv = Vec::with_capacity(2 * k.len());
    for (k, v) in k.chunks_exact(run).zip(v.chunks_exact(run)) {
        kv.extend_from_slice(k);
        kv.extend_from_slice(v);
    }
    Ok(kv.into())
}

impl SelectRequest {
    /// The request as the reflection-driven paths carry it (gRPC).
    pub(crate) fn dynamic(&self) -> PyResult<DynamicMessage> {
        let mut message = DynamicMessage::new(crate::method("SelectPages")?.input());
        message
            .transcode_from(&self.request)
            .map_err(|e| PyValueError::new_err(format!("request: {e}")))?;
        Ok(message)
    }
}
