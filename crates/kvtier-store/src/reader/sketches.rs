//! The sketches a lane's index spilled (those of NVMe-cold pages), derived
//! again for a ranking from the pages' key rows wherever they are: one
//! CRC-checked NVMe batch per call, with no host copy made (ranking is not
//! a use of the page).

use kvtier_core::rank::ColdSketches;
use kvtier_core::{Layout, LogicalPage, sketch};

use super::Reader;
use crate::page::StoreLane;

/// One lane's spilled sketches, read through `reader`.
#[derive(Debug)]
pub(crate) struct LaneSketches<'a> {
    pub(crate) reader: Reader<'a>,
    pub(crate) layout: &'a Layout,
    pub(crate) lane: &'a StoreLane,
}

impl LaneSketches<'_> {
    /// Each page's first key rows (`rows_in(p)` rows), or `None` where the
    /// page holds no original bytes (lost, summarised, gone).
    pub(crate) fn keys(&self, pages: &[usize]) -> Vec<Option<Vec<u8>>> {
        let mut at = Vec::with_capacity(pages.len());
        let mut wanted = Vec::with_capacity(pages.len());
        for (i, &p) in pages.iter().enumerate() {
            if let Some(LogicalPage::Physical(r)) = self.lane.page(p) {
                at.push(i);
                wanted.push((std::sync::Arc::clone(&r.page), self.lane.rows_in(p)));
            }
        }
        let mut out = vec![None; pages.len()];
        let reader = Reader {
            promote: false,
            touch: false,
            ..self.reader
        };
        match reader.originals(self.layout, &wanted) {
            Ok(read) => {
                for ((i, (_, rows)), kv) in at.into_iter().zip(&wanted).zip(read) {
                    out[i] = kv.map(|mut kv| {
                        kv.truncate(*rows as usize * self.layout.row_bytes());
                        kv
                    });
                }
            }
            Err(e) => tracing::error!(error = %e, "spilled sketches could not be read; ranked as zero keys"),
        }
        out
    }
}

impl ColdSketches for LaneSketches<'_> {
    fn sketches(&self, pages: &[usize]) -> Vec<Option<Vec<u8>>> {
        let (dtype, d) = (self.layout.dtype(), self.layout.head_dim() as usize);
        self.keys(pages)
            .into_iter()
            .map(|keys| keys.map(|k| sketch::encode(dtype, d, &k)))
            .collect()
    }
}
