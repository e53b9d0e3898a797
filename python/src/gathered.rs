//! A SelectPages answer with each head's K and V gathered here, in Rust:
//! what a decode step's attention reads (`kvtier.Client.select_kv`). The
//! reply is decoded as the generated types and each head's pages copied
//! straight into two buffers, K rows then V rows, in position order; no
//! dict per page is made, which is most of what a small selection cost
//! through the reflection-driven `call`.

use std::collections::HashMap;

use kvtier_client::ShmRegion;
use kvtier_proto::v1 as pb;
use prost_reflect::MessageDescriptor;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyTuple};
use tonic::Status;

use crate::reflect;

/// One head's chosen pages that came with bytes, in position order, and
/// their K rows and V rows, each concatenated.
#[derive(Debug)]
struct HeadKv {
    kv_head: u32,
    query_head: Option<u32>,
    pages: Vec<u32>,
    k: Vec<u8>,
    v: Vec<u8>,
}

/// A gathered selection: the first message's totals, timing and mode (its
/// heads and pages taken out), and every head's K and V.
#[derive(Debug)]
pub(crate) struct Gathered {
    info: pb::SelectPagesResponse,
    heads: Vec<HeadKv>,
}

impl Gathered {
    /// Gathers `replies` (a SelectPages stream's messages): each head's
    /// pages' bytes from `region` where the server wrote them there, else
    /// from the messages. A page is K rows then V rows of equal size.
    pub(crate) fn new(mut replies: Vec<pb::SelectPagesResponse>, region: Option<&ShmRegion>) -> Result<Self, Status> {
        let Some(first) = replies.first_mut() else {
            return Err(Status::internal("the server's SelectPages reply holds no message"));
        };
        // The first message without its heads and pages (put back after).
        let heads = std::mem::take(&mut first.heads);
        let pages = std::mem::take(&mut first.pages);
        let info = first.clone();
        (first.heads, first.pages) = (heads, pages);
        let data: HashMap<(u32, u32), &pb::Page> = replies
            .iter()
            .flat_map(|r| &r.pages)
            .map(|p| ((p.kv_head, p.page), p))
            .collect();
        let heads = replies
            .iter()
            .flat_map(|r| &r.heads)
            .map(|h| gather_head(h, &data, region))
            .collect::<Result<_, _>>()?;
        Ok(Self { info, heads })
    }

    /// `(info, heads)`: `info` a dict of the first message's fields as
    /// `call` gives them (`heads` and `pages` empty), `heads` a list of
    /// `(kv_head, query_head, pages, k, v)` with `pages` the page indices as
    /// little-endian u32 `bytes` and `k`, `v` `bytearray`s.
    pub(crate) fn into_py(self, py: Python<'_>, output: &MessageDescriptor) -> PyResult<Py<PyAny>> {
        let info = crate::as_dynamic(&self.info, output)
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.message().to_owned()))?;
        let info = reflect::to_dict(py, &info)?;
        let heads = self
            .heads
            .iter()
            .map(|h| {
                let pages: Vec<u8> = h.pages.iter().flat_map(|p| p.to_le_bytes()).collect();
                PyTuple::new(
                    py,
                    [
                        h.kv_head.into_pyobject(py)?.into_any(),
                        h.query_head.into_pyobject(py)?.into_any(),
                        PyBytes::new(py, &pages).into_any(),
                        PyByteArray::new(py, &h.k).into_any(),
                        PyByteArray::new(py, &h.v).into_any(),
                    ],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyTuple::new(py, [info.into_any(), PyList::new(py, heads)?.into_any()])?
            .into_any()
            .unbind())
    }
}

/// One head's pages that came with bytes (gone pages come without), K and
/// V concatenated in the selection's order, which is position order.
fn gather_head(
    head: &pb::HeadSelection,
    data: &HashMap<(u32, u32), &pb::Page>,
    region: Option<&ShmRegion>,
) -> Result<HeadKv, Status> {
    let chosen: Vec<&pb::Page> = head
        .pages
        .iter()
        .filter_map(|s| data.get(&(head.kv_head, s.page)).copied())
        .collect();
    let half = |p: &pb::Page| -> Result<usize, Status> {
        let len = if p.shm_bytes > 0 {
            p.shm_bytes
        } else {
            p.kv.len() as u64
        };
        if len % 2 != 0 {
            return Err(Status::internal(format!(
                "KV head {} page {}: {len} bytes are not K rows then V rows of equal size",
                p.kv_head, p.page
            )));
        }
        usize::try_from(len / 2).map_err(|_| Status::internal("a page larger than memory"))
    };
    let halves = chosen.iter().map(|p| half(p)).collect::<Result<Vec<_>, _>>()?;
    let total = halves.iter().sum();
    let (mut k, mut v) = (vec![0u8; total], vec![0u8; total]);
    let mut at = 0;
    for (p, &n) in chosen.iter().zip(&halves) {
        let (k_dst, v_dst) = (&mut k[at..at + n], &mut v[at..at + n]);
        if p.shm_bytes > 0 {
            let region = region.ok_or_else(|| {
                Status::internal("the server wrote pages into a region this call cannot read (another client's)")
            })?;
            let unreadable =
                |e: kvtier_client::ShmError| Status::internal(format!("the server's page in the region: {e}"));
            region.read(p.shm_offset, k_dst).map_err(unreadable)?;
            region.read(p.shm_offset + n as u64, v_dst).map_err(unreadable)?;
        } else {
            k_dst.copy_from_slice(&p.kv[..n]);
            v_dst.copy_from_slice(&p.kv[n..]);
        }
        at += n;
    }
    Ok(HeadKv {
        kv_head: head.kv_head,
        query_head: head.query_head,
        pages: chosen.iter().map(|p| p.page).collect(),
        k,
        v,
    })
}
