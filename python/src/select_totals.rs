//! A gathered selection's totals (its first message less its heads and
//! pages), kept as the generated type and made a dict only when Python
//! asks: a decode step reads one number of them (the store's time), and
//! converting all of them by reflection took more of a step's call than
//! its socket round trip.

use kvtier_proto::v1 as pb;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyTuple};

use crate::reflect;

/// What `SelectionKV` reads its totals from.
#[pyclass(frozen, module = "kvtier._native")]
pub(crate) struct SelectTotals {
    info: pb::SelectPagesResponse,
}

impl SelectTotals {
    pub(crate) fn new(info: pb::SelectPagesResponse) -> Self {
        Self { info }
    }
}

#[pymethods]
impl SelectTotals {
    /// The totals as `call` gives the first message's fields.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let output = crate::method("SelectPages")?.output();
        let info =
            crate::as_dynamic(&self.info, &output).map_err(|e| PyRuntimeError::new_err(e.message().to_owned()))?;
        reflect::to_dict(py, &info)
    }

    /// Microseconds the server's store spent on the call: its selection's
    /// (`timing.store_us`) and its append's (`appended.timing.store_us`).
    #[getter]
    fn store_us(&self) -> u64 {
        let selection = self.info.timing.as_ref().map_or(0, |t| t.store_us);
        let append = self
            .info
            .appended
            .as_ref()
            .and_then(|a| a.timing.as_ref())
            .map_or(0, |t| t.store_us);
        selection + append
    }

    /// With `attend`: `(query_heads, out, lse, tokens)`, each one `bytes`
    /// of every query head's, little-endian (u32, f32 rows, f32, u64),
    /// for numpy to read without a Python object per head; `None` without.
    #[getter]
    fn attention<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let rows = &self.info.attention;
        if rows.is_empty() {
            return Ok(None);
        }
        let bytes = |f: &dyn Fn(&pb::QueryAttention) -> Vec<u8>| {
            PyBytes::new(py, &rows.iter().flat_map(f).collect::<Vec<u8>>())
        };
        PyTuple::new(
            py,
            [
                bytes(&|a| a.query_head.to_le_bytes().to_vec()),
                bytes(&|a| a.out.to_vec()),
                bytes(&|a| a.lse.to_le_bytes().to_vec()),
                bytes(&|a| a.tokens.to_le_bytes().to_vec()),
            ],
        )
        .map(Some)
    }

    /// With `attend`: every query head's output row, in the answer's
    /// order (its query heads, consecutive), as little-endian f32 in one
    /// new `bytearray`: what a decode step wraps as its attention output
    /// (`torch.frombuffer`), with no array made per row or per call.
    fn attention_out<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyByteArray>> {
        let rows = &self.info.attention;
        let Some(first) = rows.first() else {
            return Err(PyValueError::new_err(
                "attention: this selection holds none (select with attend=True)",
            ));
        };
        let width = first.out.len();
        let ordered = width > 0
            && width.is_multiple_of(4)
            && rows.iter().enumerate().all(|(i, a)| {
                a.out.len() == width && u64::from(a.query_head) == u64::from(first.query_head) + i as u64
            });
        if !ordered {
            return Err(PyRuntimeError::new_err(
                "the server's attention rows are not one per query head, consecutive and of one width",
            ));
        }
        crate::bytearray::filled(py, width * rows.len(), |room| {
            for (dst, row) in room.chunks_exact_mut(width).zip(rows) {
                for (d, &s) in dst.iter_mut().zip(row.out.iter()) {
                    d.write(s);
                }
            }
            Ok(())
        })
    }

    /// Microseconds the server spent on the call, its append included
    /// (`timing.server_us`): less than the call's own time by what the
    /// transport and the client cost.
    #[getter]
    fn server_us(&self) -> u64 {
        self.info.timing.as_ref().map_or(0, |t| t.server_us)
    }
}
