//! `select_partitioned`: the Rust client's exact merge of a selection over
//! a sequence split by position across servers (`kvtier_client::Partitioned`),
//! for the Python package's context-parallel groups: the parts fan out on
//! the package's runtime, and the merged heads come back as dicts.

use kvtier_client::{Part, Partitioned, SelectRequest};
use kvtier_proto::v1 as pb;
use prost::Message;
use prost_reflect::DynamicMessage;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;
use tonic::Status;

use crate::{Connection, limited, reflect, service, status_error, wait};

/// The exact selection over a sequence whose pages are split by position
/// across servers: `parts`, in position order from page 0, are
/// `(connection, sequence id, first page, pages, incarnation)`; `request`
/// is a `SelectPagesRequest` dict (each part is asked for its own
/// sequence). The merged `HeadSelection`s, in global page numbers, as
/// dicts. Scores must compare across servers: quest or cuboid.
#[pyfunction]
pub(crate) fn select_partitioned(
    py: Python<'_>,
    parts: Vec<(Py<Connection>, String, u32, u32, u64)>,
    request: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    let Some((first, ..)) = parts.first() else {
        return Err(PyValueError::new_err("parts: at least one part"));
    };
    let first = first.clone_ref(py);
    let (runtime, timeout) = (first.get().runtime()?, first.get().timeout);
    let select = service()?
        .methods()
        .find(|m| m.name() == "SelectPages")
        .ok_or_else(|| PyRuntimeError::new_err("kvtier.v1.KvTier has no SelectPages"))?;
    let message = reflect::to_message(request, &select.input(), "")?;
    let message = pb::SelectPagesRequest::decode(message.encode_to_vec().as_slice())
        .map_err(|e| PyValueError::new_err(format!("request: {e}")))?;
    let parts = parts
        .into_iter()
        .map(|(conn, sequence_id, first_page, pages, incarnation)| Part {
            client: conn.get().client.clone().with_incarnation(incarnation),
            sequence_id,
            first_page,
            pages,
        })
        .collect();
    let mut partitioned = Partitioned::new(parts).map_err(PyValueError::new_err)?;
    let request = SelectRequest::from_message(&message);
    let merging = limited(timeout, async {
        partitioned.select(&request).await.map_err(|e| match e {
            kvtier_client::ClientError::Status(s) => s,
            other => Status::unavailable(other.to_string()),
        })
    });
    let heads = wait(py, runtime, merging)?.map_err(|status| status_error(py, &status))?;
    let head = select
        .output()
        .get_field_by_name("heads")
        .and_then(|f| f.kind().as_message().cloned())
        .ok_or_else(|| PyRuntimeError::new_err("SelectPagesResponse has no heads"))?;
    let dicts = heads
        .iter()
        .map(|h| {
            let dynamic = DynamicMessage::decode(head.clone(), h.encode_to_vec().as_slice())
                .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
            reflect::to_dict(py, &dynamic)
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(PyList::new(py, dicts)?.into_any().unbind())
}
