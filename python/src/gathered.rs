//! A SelectPages answer with each head's K and V gathered here, in Rust:
//! what a decode step's attention reads (`kvtier.Client.select_kv`). The
//! reply is decoded as the generated types and each head's pages copied
//! once, straight into the two `bytearray`s Python gets, K rows then V
//! rows, in position order; no dict per page is made, which is most of
//! what a small selection cost through the reflection-driven `call`.

use std::collections::HashMap;

use kvtier_client::ShmRegion;
use kvtier_proto::v1 as pb;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyTuple};
use tonic::Status;

use crate::select_totals::SelectTotals;

/// Where one chosen page's bytes are: in the region (its K rows' offset,
/// its V rows'), or in a message (reply, page).
#[derive(Debug, Clone, Copy)]
enum Source {
    Region(u64, u64),
    Message(usize, usize),
}

/// One head's chosen pages that came with bytes, in position order.
#[derive(Debug)]
struct HeadPages {
    kv_head: u32,
    query_head: Option<u32>,
    /// `(page, where its bytes are, bytes per half)`.
    pages: Vec<(u32, Source, usize)>,
}

/// A gathered selection: the first message's totals, timing and mode (its
/// heads and pages taken out), and where every head's pages are.
#[derive(Debug)]
pub(crate) struct Gathered {
    info: pb::SelectPagesResponse,
    replies: Vec<pb::SelectPagesResponse>,
    heads: Vec<HeadPages>,
}

impl Gathered {
    /// Plans the gathering of `replies` (a SelectPages stream's
    /// messages): each head's pages that came with bytes, from the region
    /// where the server wrote them there, else from the messages. A page
    /// is K rows then V rows of equal size.
    pub(crate) fn new(mut replies: Vec<pb::SelectPagesResponse>) -> Result<Self, Status> {
        let Some(first) = replies.first_mut() else {
            return Err(Status::internal("the server's SelectPages reply holds no message"));
        };
        // The first message without its heads and pages (put back after).
        let heads = std::mem::take(&mut first.heads);
        let pages = std::mem::take(&mut first.pages);
        let info = first.clone();
        (first.heads, first.pages) = (heads, pages);
        let data: HashMap<(u32, u32), (usize, usize)> = replies
            .iter()
            .enumerate()
            .flat_map(|(r, m)| {
                m.pages
                    .iter()
                    .enumerate()
                    .map(move |(i, p)| ((p.kv_head, p.page), (r, i)))
            })
            .collect();
        let heads = replies
            .iter()
            .flat_map(|r| &r.heads)
            .map(|h| plan_head(h, &data, &replies))
            .collect::<Result<_, _>>()?;
        Ok(Self { info, replies, heads })
    }

    /// `(totals, heads)`: `totals` the first message's fields but `heads`
    /// and `pages` ([`SelectTotals`]), `heads` a list of
    /// `(kv_head, query_head, pages, k, v)` with `pages` the page indices as
    /// little-endian u32 `bytes` and `k`, `v` `bytearray`s. Pages in
    /// `region` are read from it: the caller holds it, so that no later
    /// call overwrites them first. With `views`, a head whose K rows and V
    /// rows each lie in one run of the region (`gather_heads`) gives `k`
    /// and `v` as `(offset, length)` in it instead, copied nowhere.
    pub(crate) fn into_py(self, py: Python<'_>, region: Option<&ShmRegion>, views: bool) -> PyResult<Py<PyAny>> {
        let heads = self
            .heads
            .iter()
            .map(|h| {
                let pages: Vec<u8> = h.pages.iter().flat_map(|(p, ..)| p.to_le_bytes()).collect();
                // A run the region does not hold is copied, which refuses it.
                let in_region = |(k, v, length): &(u64, u64, usize)| {
                    region.is_some_and(|r| [k, v].iter().all(|&&at| at + *length as u64 <= r.len() as u64))
                };
                let (k, v) = match h.runs().filter(|run| views && in_region(run)) {
                    Some((k, v, length)) => (
                        (k, length).into_pyobject(py)?.into_any(),
                        (v, length).into_pyobject(py)?.into_any(),
                    ),
                    None => (
                        self.half(py, h, 0, region)?.into_any(),
                        self.half(py, h, 1, region)?.into_any(),
                    ),
                };
                PyTuple::new(
                    py,
                    [
                        h.kv_head.into_pyobject(py)?.into_any(),
                        h.query_head.into_pyobject(py)?.into_any(),
                        PyBytes::new(py, &pages).into_any(),
                        k,
                        v,
                    ],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        let totals = Bound::new(py, SelectTotals::new(self.info))?;
        Ok(
            PyTuple::new(py, [totals.into_any(), PyList::new(py, heads)?.into_any()])?
                .into_any()
                .unbind(),
        )
    }

    /// One head's K rows (`half` 0) or V rows (1), its pages' in order, in
    /// a new `bytearray`.
    fn half<'py>(
        &self,
        py: Python<'py>,
        head: &HeadPages,
        half: usize,
        region: Option<&ShmRegion>,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        let total = head.pages.iter().map(|&(.., n)| n).sum();
        crate::bytearray::filled(py, total, |out| {
            let mut at = 0;
            for &(page, source, n) in &head.pages {
                let dst = &mut out[at..at + n];
                match source {
                    Source::Region(k, v) => {
                        let offset = if half == 0 { k } else { v };
                        let internal = |message: String| crate::status_error(py, &Status::internal(message));
                        let region = region.ok_or_else(|| {
                            internal(
                                "the server wrote pages into a region this call cannot read (another client's)"
                                    .to_owned(),
                            )
                        })?;
                        region.read_uninit(offset, dst).map_err(|e| {
                            internal(format!(
                                "KV head {} page {page}: the server's page in the region: {e}",
                                head.kv_head
                            ))
                        })?;
                    }
                    Source::Message(r, i) => {
                        let src = &self.replies[r].pages[i].kv[half * n..(half + 1) * n];
                        for (d, &s) in dst.iter_mut().zip(src) {
                            d.write(s);
                        }
                    }
                }
                at += n;
            }
            Ok(())
        })
    }
}

impl HeadPages {
    /// Where its K rows and its V rows lie in the region, each one run:
    /// `(k_offset, v_offset, length)`; `None` when they do not (pages from
    /// the messages, or apart), or it has none.
    fn runs(&self) -> Option<(u64, u64, usize)> {
        let &(_, Source::Region(k, v), _) = self.pages.first()? else {
            return None;
        };
        let mut length = 0;
        for &(_, source, n) in &self.pages {
            match source {
                Source::Region(pk, pv) if pk == k + length as u64 && pv == v + length as u64 => length += n,
                _ => return None,
            }
        }
        Some((k, v, length))
    }
}

/// Where one head's pages that came with bytes (gone pages come without)
/// are, in the selection's order, which is position order.
fn plan_head(
    head: &pb::HeadSelection,
    data: &HashMap<(u32, u32), (usize, usize)>,
    replies: &[pb::SelectPagesResponse],
) -> Result<HeadPages, Status> {
    let pages = head
        .pages
        .iter()
        .filter_map(|s| data.get(&(head.kv_head, s.page)).copied())
        .map(|(r, i)| {
            let p = &replies[r].pages[i];
            let (len, source) = if p.shm_bytes > 0 {
                let v = p.shm_v_offset.unwrap_or(p.shm_offset + p.shm_bytes / 2);
                (p.shm_bytes, Source::Region(p.shm_offset, v))
            } else {
                (p.kv.len() as u64, Source::Message(r, i))
            };
            if len % 2 != 0 {
                return Err(Status::internal(format!(
                    "KV head {} page {}: {len} bytes are not K rows then V rows of equal size",
                    p.kv_head, p.page
                )));
            }
            let half = usize::try_from(len / 2).map_err(|_| Status::internal("a page larger than memory"))?;
            Ok((p.page, source, half))
        })
        .collect::<Result<_, _>>()?;
    Ok(HeadPages {
        kv_head: head.kv_head,
        query_head: head.query_head,
        pages,
    })
}
